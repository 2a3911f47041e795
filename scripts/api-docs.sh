#!/usr/bin/env bash
# The API reference: HTML generated from the docstrings by pdoc, written to build/api/ (open
# build/api/index.html). scripts/test.sh runs it, so the reference is rebuilt on every CI run and a
# docstring or annotation pdoc cannot render fails the build instead of going stale.
#
# Every warning pdoc (or an import it makes) gives is an error, except the ones listed in KNOWN below,
# each with the reason it cannot be fixed in a docstring. A listed warning that no longer appears is an
# error too, so the list shrinks when the code is fixed and cannot hide a new warning.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
out=build/api
rm -rf "$out"
.venv/bin/python - "$out" <<'PY'
import sys
import warnings
from pathlib import Path

import pdoc
import pdoc.render

# The public surface: the package root (what `import arrow_ipc_bridge as aib` gives), the errors, and
# the lower-level modules docs/api.md names. Private modules (a leading underscore) stay out.
MODULES = [
    "arrow_ipc_bridge",
    "arrow_ipc_bridge.errors",
    "arrow_ipc_bridge.cuda",
    "arrow_ipc_bridge.host",
    "arrow_ipc_bridge.wire.capsules",
    "arrow_ipc_bridge.wire.metadata",
    "arrow_ipc_bridge.wire.layout",
    "arrow_ipc_bridge.transport",
    "arrow_ipc_bridge.transport.channel",
]

# pdoc evaluates a string type alias in the namespace of the module that uses it, where the alias's
# own names (capsules.ArrowInput's protocols) are not imported; and it evaluates a method's
# annotations in its class's namespace, where `list` is Session.list itself. Both render as the
# annotation's text, which reads correctly; making pdoc resolve them takes a change to the code.
_ARROW_INPUT = "Import of ArrowDeviceArrayExportable failed: name 'ArrowDeviceArrayExportable' is not defined"
_UNION = "unsupported operand type(s) for |: 'str' and 'type'"
KNOWN = {
    f"Error parsing type annotation ArrowInput for arrow_ipc_bridge.{name}. {_ARROW_INPUT}"
    for name in ("Publisher.publish", "export", "to_device")
} | {
    f"Error parsing type annotation ArrowInput | CapturedData for arrow_ipc_bridge.StreamWriter.write: {_UNION}"
} | {
    "Error parsing type annotation list[str] for arrow_ipc_bridge.Session.list: "
    "'function' object is not subscriptable",
}

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # numpy: the docstrings mix reStructuredText roles with numpydoc sections; pdoc's numpy format
    # converts both.
    pdoc.render.configure(docformat="numpy", footer_text="arrow_ipc_bridge API reference")
    pdoc.pdoc(*MODULES, output_directory=Path(sys.argv[1]))

seen = {str(w.message) for w in caught}
new = sorted(f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
             if str(w.message) not in KNOWN)
stale = sorted(KNOWN - seen)
for line in new:
    print(f"api-docs: warning: {line}", file=sys.stderr)
for line in stale:
    print(f"api-docs: listed in KNOWN but no longer given (remove it from scripts/api-docs.sh): {line}",
          file=sys.stderr)
if new or stale:
    sys.exit(1)
print(f"api-docs: {len(MODULES)} modules documented in {sys.argv[1]}/ ({len(seen)} known warnings)")
PY
