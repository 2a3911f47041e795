"""``python -m arrow_ipc_bridge`` (see cli/)."""

import sys

from arrow_ipc_bridge.cli import main

sys.exit(main())
