#!/usr/bin/env bash
# The README's test command: set up, lint, type-check, run the tests (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# every mutant of tests/mutation/mutants.toml still applies to the code (~1 s; the run itself is separate)
.venv/bin/python scripts/mutate.py --check
bash scripts/api-docs.sh  # the API reference (build/api/) from the docstrings; fails on any pdoc warning
.venv/bin/python -m pytest "$@"
