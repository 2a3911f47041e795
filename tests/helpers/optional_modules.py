"""Whether an optional package imports here, asked of a fresh interpreter.

``importlib.util.find_spec`` only says a package is installed; a package may be installed and still
fail to import (cuDF against a numba-cuda that a newer numpy broke raises ``AttributeError``, which
``pytest.importorskip`` does not catch). The import runs in a child process so that a package that
initialises CUDA when imported never does so in the test process (which forks and spawns later)."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

__all__ = ["import_failure"]


@functools.cache
def import_failure(name: str) -> str | None:
    """None when ``import name`` succeeds in a fresh interpreter; otherwise why not, in a few words
    (for a skip reason)."""
    if importlib.util.find_spec(name) is None:
        return "not installed"
    try:
        result = subprocess.run(
            [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300, check=False
        )
    except subprocess.TimeoutExpired:
        return "its import did not finish in 300 s"
    if result.returncode == 0:
        return None
    lines = result.stderr.strip().splitlines()
    return f"installed, but its import fails ({lines[-1] if lines else f'exit code {result.returncode}'})"
