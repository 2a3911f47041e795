#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package in editable mode with its test and lint tools.
# Everything comes from the package registries; the C core is built by pip (gcc + Python headers).
#
# A second run skips what is installed already: .venv/ keeps a stamp of the install inputs as of the
# last successful run. pip runs again only when pyproject.toml or setup.py changed (dependencies,
# build settings); the C core is rebuilt in place when anything it is compiled from changed
# (cffi_build/, the version compiled into it) or its module is missing. Delete .venv/ to start over.
set -euo pipefail
cd "$(dirname "$0")/.."

# Hash of the named files' names and contents (sorted, so the order of the arguments does not matter).
hash_of() {
  find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum |
    sha256sum | cut -d' ' -f1
}

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp_dir=.venv/aib-install-stamps
mkdir -p "$stamp_dir"
python_id=$(.venv/bin/python -c 'import sys; print(sys.version)')
deps_hash=$( (hash_of pyproject.toml setup.py && echo "$python_id") | sha256sum | cut -d' ' -f1)
core_hash=$( (hash_of cffi_build arrow_ipc_bridge/_version.py && echo "$python_id") | sha256sum | cut -d' ' -f1)

if [ "$(cat "$stamp_dir/deps" 2>/dev/null)" != "$deps_hash" ]; then
  rm -f "$stamp_dir/deps" "$stamp_dir/core"
  .venv/bin/python -m pip install -q --upgrade pip
  # The editable install builds the C core in place as well.
  .venv/bin/python -m pip install -q -e ".[dev]"
elif [ "$(cat "$stamp_dir/core" 2>/dev/null)" != "$core_hash" ] ||
  ! compgen -G "arrow_ipc_bridge/_bridge_core*.so" >/dev/null; then
  rm -f "$stamp_dir/core"
  if .venv/bin/python -c "import setuptools, cffi" 2>/dev/null; then
    # --force: a source edited within the same second as the last build would otherwise be skipped.
    if ! .venv/bin/python setup.py -q build_ext --inplace --force >.venv/aib-build-ext.log 2>&1; then
      cat .venv/aib-build-ext.log >&2
      exit 1
    fi
  else
    # No setuptools in the environment (Python 3.12+ venvs have none): let pip build it in isolation.
    .venv/bin/python -m pip install -q --no-deps -e .
  fi
fi
# Written only now that every step above succeeded (set -e), so a failed install is retried.
echo "$deps_hash" >"$stamp_dir/deps"
echo "$core_hash" >"$stamp_dir/core"
