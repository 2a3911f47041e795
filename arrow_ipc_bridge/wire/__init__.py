"""The wire: what a message says and the rules it is checked against, on both sides.

- :mod:`.capsules`: PyCapsules in and out; capturing any Arrow producer into a C owner.
- :mod:`.layout`: Arrow format strings to layout rules (buffers, minimum sizes, children).
- :mod:`.metadata`: the metadata tree: describe, encode, decode and validate, rebuild structs.

Below the memory layers (``host/``, ``cuda/``), which name regions with :mod:`.metadata`'s types.
"""
