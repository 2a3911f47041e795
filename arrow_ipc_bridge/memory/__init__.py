"""Host memory the bridge exports and maps: shared memory (``host``) and its mappings (``host_map``).

CUDA memory is :mod:`arrow_ipc_bridge.cuda`.
"""
