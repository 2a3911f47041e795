#!/usr/bin/env bash
# Creates .venv (if missing) and installs the package in editable mode with its test and lint tools.
# Everything comes from the package registries; the C core is built by pip (gcc + Python headers).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
