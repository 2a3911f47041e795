"""A producer process exits with status 0 right after its publisher closed, every time.

It aborted now and then ("terminate called without an active exception", status -6): closing a
publisher lets go of its exports, and the reaper thread closes them, releasing the producer's
buffers. pyarrow's NumPy-backed and foreign buffers take the GIL in their C++ destructor; when the
process was already finalizing, that took the daemon reaper thread down with ``pthread_exit``, whose
unwinding through the destructor called ``std::terminate`` (``_reaper.py`` stops the thread at exit
now). The producers here publish a table whose buffers' owner takes a moment to let go, so the
release is still running when the main thread reaches the exit: before the fix most runs aborted
(a plain NumPy-backed table did 1-2 times in 20 on a busy machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RUNS = 50
TIMEOUT_S = 120

# A 1,000-row table: a column in shared memory (zero-copy: the export keeps the whole capture until it
# closes), a NumPy-backed one, and one over a buffer whose owner (a Python object, like a NumPy
# array's base) takes 50 ms to let go. Published, then the with block is left and the script ends.
_PRODUCER = textwrap.dedent(
    """
    import os, sys, tempfile, time
    import numpy as np
    import pyarrow as pa
    import arrow_ipc_bridge as aib

    class SlowOwner:
        def __init__(self, values):
            self.values = values
        def __del__(self):
            time.sleep(0.05)

    rows = 1000
    shared = aib.allocate_shared(rows * 8)
    np.frombuffer(shared.view(), dtype=np.int64)[:] = np.arange(rows)
    values = np.arange(rows, dtype=np.int64)
    slow = pa.foreign_buffer(values.ctypes.data, values.nbytes, base=SlowOwner(values))
    table = pa.table({
        "shared": pa.Array.from_buffers(pa.int64(), rows, [None, shared.as_pyarrow()]),
        "numpy": np.arange(rows),
        "slow": pa.Array.from_buffers(pa.int64(), rows, [None, slow]),
    })
    shared.close()
    del slow
    directory = tempfile.mkdtemp()
    with aib.Publisher(os.path.join(directory, "p.sock")) as publisher:
        stats = publisher.publish("t", table)
        assert stats.zero_copy_regions == 1, stats
        del table
    os.rmdir(directory)
    """
)


def _run_producer(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def test_a_producer_exits_with_status_0_after_its_publisher_closed(tmp_path: Path) -> None:
    script = tmp_path / "producer.py"
    script.write_text(_PRODUCER)
    # Two or more at once: each run is mostly interpreter start-up, and the load is part of the test.
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        runs = list(pool.map(_run_producer, [script] * RUNS))
    failed = [(run.returncode, run.stderr[-2000:]) for run in runs if run.returncode != 0]
    assert failed == [], f"{len(failed)} of {RUNS} producers failed: {failed[:3]}"
