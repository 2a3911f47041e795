"""The package version; compiled into the C core too, and checked at import (see _ffi.py)."""

__version__ = "0.1.0"
