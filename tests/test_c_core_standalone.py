"""The C core builds and works as a plain C library of its own, with no Python.

``cffi_build/build_bridge.py`` splits the extension's sources in two: the core (``CORE_SOURCES``:
decode, encode, map, own memory, frames, the CUDA driver calls) and the binding (``PYTHON_SOURCES``:
capsules, builtins, C-typed state). These tests compile the core alone with the system C compiler
into a shared library whose every symbol resolves without libpython, then drive it from a C program:
a message decoded, its column rebuilt over the program's own memory and read back, every struct
released to a leak count of zero, and a truncated message refused with an error.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import struct
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from helpers import wire_craft as wc

ROOT = Path(__file__).resolve().parent.parent
CFFI_BUILD = ROOT / "cffi_build"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")

_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "bridge.h"

/* argv[1]: a message file. Decodes it, rebuilds batch 0 over VALUES (region 0 is this program's
 * memory) and prints what the rebuilt array holds, then the core's live counts after release. */
static int64_t VALUES[8] = {11, 22, 33, 44, 0, 0, 0, 0};

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  FILE *f = fopen(argv[1], "rb");
  if (f == NULL) return 2;
  uint8_t buf[4096];
  size_t n = fread(buf, 1, sizeof buf, f);
  fclose(f);
  aib_decoded *d = NULL;
  aib_error err;
  memset(&err, 0, sizeof err);
  int rc = aib_decode(buf, n, 1, 0, &d, &err);
  if (rc != 0) {
    printf("refused %d %s %s\n", rc, d == NULL ? "null" : "set", err.message[0] ? "message" : "silent");
    return 0;
  }
  printf("decoded kind=%u batches=%lld regions=%zu\n", aib_decoded_message_kind(d),
         (long long)aib_decoded_batch_count(d), aib_decoded_region_count(d));
  aib_owner *owner = aib_owner_new(0);
  aib_owner_attach_decoded(owner, d);
  uint64_t bases[1] = {(uint64_t)(uintptr_t)VALUES};
  struct ArrowSchema schema;
  struct ArrowArray array;
  if (aib_rebuild_schema(d, &schema, &err) != 0 ||
      aib_rebuild_array(d, 0, bases, 1, owner, &array, &err) != 0) {
    printf("rebuild failed: %s\n", err.message);
    return 1;
  }
  const int64_t *values = (const int64_t *)array.buffers[1];
  printf("format=%s length=%lld values=", schema.format, (long long)array.length);
  for (int64_t i = 0; i < array.length; i++)
    printf("%lld%s", (long long)values[i], i + 1 < array.length ? "," : "\n");
  aib_owner_unref(owner); /* the structs hold their own references */
  printf("while held: owners=%lld\n", (long long)aib_live_owners());
  array.release(&array);
  schema.release(&schema);
  printf("after release: owners=%lld nodes=%lld\n", (long long)aib_live_owners(),
         (long long)aib_live_nodes());
  return 0;
}
"""


def _builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("aib_build_bridge", CFFI_BUILD / "build_bridge.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def core_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The core compiled alone into libaibcore.so, and a C program linked against it."""
    out = tmp_path_factory.mktemp("core")
    builder = _builder()
    flags = ["-std=gnu11", "-O1", "-Wall", "-fPIC", f"-I{CFFI_BUILD}", '-DAIB_VERSION="standalone"']
    objects = []
    for name in builder.CORE_SOURCES:
        obj = out / (Path(name).stem + ".o")
        subprocess.run(["cc", *flags, "-c", str(CFFI_BUILD / name), "-o", str(obj)], check=True)
        objects.append(str(obj))
    library = out / "libaibcore.so"
    # --no-undefined: every symbol the core uses must resolve here, with no libpython to lend one.
    subprocess.run(
        ["cc", "-shared", "-Wl,--no-undefined", "-o", str(library), *objects, "-lpthread"], check=True
    )
    source = out / "program.c"
    source.write_text(_PROGRAM)
    program = out / "program"
    subprocess.run(
        ["cc", *flags, str(source), "-o", str(program), f"-L{out}", "-laibcore", f"-Wl,-rpath,{out}"],
        check=True,
    )
    return program


def test_core_sources_do_not_include_python() -> None:
    builder = _builder()
    assert set(builder.C_SOURCES) == set(builder.CORE_SOURCES) | set(builder.PYTHON_SOURCES)
    on_disk = {p.name for p in CFFI_BUILD.glob("*.c")}
    assert on_disk == set(builder.C_SOURCES), "every C file is either core or binding"
    include = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
    for name in builder.CORE_SOURCES:
        seen: set[str] = set()
        todo = [name]
        while todo:  # the file and every project header it pulls in, transitively
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            for header in include.findall((CFFI_BUILD / current).read_text()):
                # Python.h, or a binding header (which expects Python.h before it)
                assert header != "Python.h", f"{name} reaches Python.h through {current}"
                assert not header.startswith("py_"), f"{name} reaches the binding's {header}"
                if (CFFI_BUILD / header).exists():
                    todo.append(header)


def test_core_library_needs_no_python_symbols(core_program: Path) -> None:
    library = core_program.parent / "libaibcore.so"
    undefined = subprocess.run(["nm", "-u", "-D", str(library)], capture_output=True, text=True, check=True)
    assert not [line for line in undefined.stdout.splitlines() if re.search(r"\bPy", line)]


def _run(program: Path, message: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(program), str(message)], capture_output=True, text=True, timeout=30, check=False
    )


def _message_file(tmp_path: Path, values: int = 4) -> Path:
    schema, node = wc.int64_column(values)
    message = wc.message(schema, [[node]], [wc.Region(size=64)])
    path = tmp_path / "message.bin"
    path.write_bytes(message)
    return path


def test_core_decodes_and_rebuilds_without_python(core_program: Path, tmp_path: Path) -> None:
    path = _message_file(tmp_path)
    done = _run(core_program, path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "decoded kind=1 batches=1 regions=1"
    assert lines[1] == "format=l length=4 values=11,22,33,44"
    assert lines[2] == "while held: owners=1"  # the structs keep the owner alive
    assert lines[3] == "after release: owners=0 nodes=0"


def test_core_refuses_a_truncated_message_without_python(core_program: Path, tmp_path: Path) -> None:
    path = _message_file(tmp_path)
    whole = path.read_bytes()
    (length,) = struct.unpack_from("<I", whole, 8)
    assert length == len(whole) - 16  # the header's body length: the cut below breaks it
    path.write_bytes(whole[:-3])
    done = _run(core_program, path)
    assert done.returncode == 0, done.stdout + done.stderr
    code, state, said = done.stdout.split()[1:]
    assert int(code) != 0
    assert state == "null"  # nothing decoded is handed out
    assert said == "message"  # the error says what is wrong
