#!/usr/bin/env bash
# The README's main job: a producer process publishes a table, a consumer process imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/python -m arrow_ipc_bridge demo "$@"
