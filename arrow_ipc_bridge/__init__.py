"""arrow_ipc_bridge: zero-copy hand-off of Apache Arrow data between processes on one host."""

from arrow_ipc_bridge._version import __version__

__all__ = ["__version__"]
