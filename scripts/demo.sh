#!/usr/bin/env bash
# The README's main job: a producer process publishes a table, a consumer process imports it.
# Installs only what the demo runs (the package with pyarrow and cffi; scripts/test.sh adds the
# test and development tools): the demo moves host Arrow data, and GPU data with the bridge's own
# CUDA driver calls, so it needs no CuPy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh runtime
exec .venv/bin/python -m arrow_ipc_bridge demo "$@"
