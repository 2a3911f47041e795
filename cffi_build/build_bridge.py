"""cffi builder for the C core (API mode): ``setup.py`` names ``ffibuilder`` here.

The C declarations live in real header files; cdef reads them with preprocessor lines stripped
(cdef understands only ``#define NAME <integer>``). The package version is compiled in, and
``arrow_ipc_bridge/_ffi.py`` refuses to load a core built from another version.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The core: plain C with no Python.h (it decodes, maps and owns memory; it could be built as a library
# of its own, which tests/test_c_core_standalone.py does). Order: each file after what it uses.
CORE_SOURCES = [
    "base.c",
    "owner.c",
    "struct_trees.c",
    "layout.c",
    "wire_model.c",
    "wire_describe.c",
    "wire_encode.c",
    "wire_decode.c",
    "wire_rebuild.c",
    "content_check.c",
    "channel.c",
    "board.c",
    "serve.c",
    "remembered.c",
    "stream_consume.c",
    "cuda_batch.c",
    "cuda_export.c",
    "region_table.c",
    "sync_event.c",
    "columns.c",
    "host_system.c",
]
# The binding: Python objects made, read and destroyed in C (capsules, builtins, C-typed state).
PYTHON_SOURCES = [
    "py_capsules.c",
    "py_columns.c",
    "py_hot.c",
    "py_state.c",
    "py_local_get.c",
]
C_SOURCES = CORE_SOURCES + PYTHON_SOURCES
HEADERS = ["arrow_c_abi.h", "bridge.h", "bridge_cuda.h", "bridge_stream.h"]
_INTEGER_DEFINE = re.compile(r"^#define\s+\w+\s+-?\d+\s*(/\*.*\*/)?\s*$")


def _relative(path: Path) -> str:
    # setuptools wants source paths relative to the project root (setup.py's directory).
    try:
        return os.path.relpath(path, Path.cwd())
    except ValueError:
        return str(path)


def _cdef_text(header: Path) -> str:
    lines = []
    for line in header.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and not _INTEGER_DEFINE.match(stripped):
            continue
        lines.append(line)
    return "\n".join(lines)


def _version() -> str:
    text = (ROOT / "arrow_ipc_bridge" / "_version.py").read_text()
    match = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    if match is None:
        raise RuntimeError("arrow_ipc_bridge/_version.py has no __version__")
    return match.group(1)


ffibuilder = FFI()
ffibuilder.cdef("\n".join(_cdef_text(HERE / name) for name in HEADERS))
ffibuilder.set_source(
    "arrow_ipc_bridge._bridge_core",
    '#include "bridge.h"\n',
    sources=[_relative(HERE / name) for name in C_SOURCES],
    include_dirs=[_relative(HERE)],
    define_macros=[("AIB_VERSION", '"' + _version() + '"')],
    extra_compile_args=[
        "-std=gnu11",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        "-fvisibility=hidden",
    ],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(ROOT), verbose=True)
