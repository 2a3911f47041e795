"""Integrations of the bridge with other frameworks, one module each, each importing its framework.

Nothing here is imported by ``import arrow_ipc_bridge``: a module is loaded only when it is named,
so the package works without any of the frameworks installed.

- :mod:`arrow_ipc_bridge.integrations.ray` -- a Ray tensor transport that passes Arrow data between
  actors through the bridge (``docs/consumers/ray.md``); needs ``ray>=2.60``
  (``pip install arrow_ipc_bridge[ray]``).
"""
