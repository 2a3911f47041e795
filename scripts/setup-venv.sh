#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package in editable mode, building its C core.
# Everything comes from the package registries; the C core is built by pip (gcc + Python headers).
#
#   bash scripts/setup-venv.sh [dev]   the package with its test and lint tools (scripts/test.sh)
#   bash scripts/setup-venv.sh runtime the package and its runtime dependencies only, pyarrow and
#                                      cffi (scripts/demo.sh: what the demo runs, nothing more)
#
# A second run skips what is installed already: .venv/ keeps a stamp of the install inputs per mode
# as of the last successful run (a dev install covers the runtime one). pip runs again only when
# pyproject.toml or setup.py changed (dependencies, build settings); the C core is rebuilt in place
# when anything it is compiled from changed (cffi_build/, the version compiled into it) or its
# module is missing. A line on stderr says what each slow step is doing. Delete .venv/ to start over.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-dev}
case "$mode" in
  dev) extras="[dev]" what="the package with its test and development tools (pytest, ruff, mypy, pdoc, ...)" ;;
  runtime) extras="" what="the package and its runtime dependencies (pyarrow, cffi)" ;;
  *)
    echo "usage: $0 [dev|runtime]" >&2
    exit 2
    ;;
esac

say() { echo "setup-venv: $*" >&2; }

# Hash of the named files' names and contents (sorted, so the order of the arguments does not matter).
hash_of() {
  find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum |
    sha256sum | cut -d' ' -f1
}

if [ ! -x .venv/bin/python ]; then
  say "creating .venv/"
  python3 -m venv .venv
fi
stamp_dir=.venv/aib-install-stamps
mkdir -p "$stamp_dir"
python_id=$(.venv/bin/python -c 'import sys; print(sys.version)')
deps_hash=$( (hash_of pyproject.toml setup.py && echo "$python_id") | sha256sum | cut -d' ' -f1)
core_hash=$( (hash_of cffi_build arrow_ipc_bridge/_version.py && echo "$python_id") | sha256sum | cut -d' ' -f1)

deps_current() { # whether mode $1's dependencies are installed for these inputs
  [ "$(cat "$stamp_dir/deps-$1" 2>/dev/null)" = "$deps_hash" ]
}

if ! deps_current "$mode" && ! { [ "$mode" = runtime ] && deps_current dev; }; then
  rm -f "$stamp_dir/deps-$mode" "$stamp_dir/core"
  # pip 21.3 is the first to install a pyproject.toml project in editable mode (PEP 660).
  if ! .venv/bin/python -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (21, 3))'; then
    say "upgrading pip in .venv/"
    .venv/bin/python -m pip install -q --upgrade pip
  fi
  say "installing $what and building the C core (a minute or two the first time)"
  if [ "$mode" = dev ]; then
    # setuptools as the build needs it (build-system requires), for the in-place rebuilds below.
    .venv/bin/python -m pip install -q -e ".$extras" "setuptools>=77"
  else
    .venv/bin/python -m pip install -q -e ".$extras"
  fi
elif [ "$(cat "$stamp_dir/core" 2>/dev/null)" != "$core_hash" ] ||
  ! compgen -G "arrow_ipc_bridge/_bridge_core*.so" >/dev/null; then
  rm -f "$stamp_dir/core"
  say "rebuilding the C core (its sources changed, or its module is missing)"
  # The in-place build reads pyproject.toml with the environment's setuptools, which must be one the
  # build allows (the SPDX license string needs 77); a runtime-only .venv has none, or an older one.
  if .venv/bin/python -c 'import sys, setuptools, cffi; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    # --force: a source edited within the same second as the last build would otherwise be skipped.
    if ! .venv/bin/python setup.py -q build_ext --inplace --force >.venv/aib-build-ext.log 2>&1; then
      cat .venv/aib-build-ext.log >&2
      exit 1
    fi
  else
    # No suitable setuptools in the environment: let pip build it in isolation.
    .venv/bin/python -m pip install -q --no-deps -e .
  fi
fi
# Written only now that every step above succeeded (set -e), so a failed install is retried.
echo "$deps_hash" >"$stamp_dir/deps-$mode"
echo "$core_hash" >"$stamp_dir/core"
