"""A producer process exits with status 0 right after its publisher closed, every time.

It aborted now and then ("terminate called without an active exception", status -6): closing a
publisher lets go of its exports, and the reaper thread closes them, releasing the producer's
buffers; a ``publish_stream`` pump thread writes and releases batches until it notices the stream
closed. pyarrow's NumPy-backed and foreign buffers take the GIL in their C++ destructor; when the
process was already finalizing, that took the daemon thread down with ``pthread_exit``, whose
unwinding through the destructor called ``std::terminate``. Both threads are stopped at exit now
(``runtime/reaper.py``, ``producer/stream_writer.py``). The producer here publishes a table and a stream whose
buffers' owner takes a moment to let go, so a release is still running when the main thread reaches
the exit: before the fixes about half the runs aborted (a plain NumPy-backed table did 1-2 times
in 20 on a busy machine).
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

# The owner of a buffer that takes a moment to let go (a Python object, like a NumPy array's base).
_SLOW_COLUMN = """
import os, sys, tempfile, time
import numpy as np
import pyarrow as pa
import arrow_ipc_bridge as aib

class SlowOwner:
    def __init__(self, values, seconds):
        self.values = values
        self.seconds = seconds
    def __del__(self):
        time.sleep(self.seconds)

def slow_column(rows, seconds):
    values = np.arange(rows, dtype=np.int64)
    slow = pa.foreign_buffer(values.ctypes.data, values.nbytes, base=SlowOwner(values, seconds))
    return pa.Array.from_buffers(pa.int64(), rows, [None, slow])
"""

# A 1,000-row table: a column in shared memory (zero-copy: the export keeps the whole capture until it
# closes, and the reaper thread closes it), a NumPy-backed one and a slow one. Published; then the
# with block is left and the script ends.
_TABLE_PRODUCER = _SLOW_COLUMN + textwrap.dedent(
    """
    rows = 1000
    shared = aib.allocate_shared(rows * 8)
    np.frombuffer(shared.view(), dtype=np.int64)[:] = np.arange(rows)
    table = pa.table({
        "shared": pa.Array.from_buffers(pa.int64(), rows, [None, shared.as_pyarrow()]),
        "numpy": np.arange(rows),
        "slow": slow_column(rows, 0.05),
    })
    shared.close()
    directory = tempfile.mkdtemp()
    with aib.Publisher(os.path.join(directory, "p.sock")) as publisher:
        stats = publisher.publish("t", table)
        assert stats.zero_copy_regions == 1, stats
        del table
    os.rmdir(directory)
    """
)

# A live stream pumped from a generator of 1,000-row batches (a NumPy-backed and a slow column): the
# with block is left while the pump writes, and the script ends.
_STREAM_PRODUCER = _SLOW_COLUMN + textwrap.dedent(
    """
    def batches():
        while True:
            yield pa.record_batch({"numpy": np.arange(1000), "slow": slow_column(1000, 0.01)})

    directory = tempfile.mkdtemp()
    with aib.Publisher(os.path.join(directory, "p.sock")) as publisher:
        publisher.publish_stream("s", batches())
        time.sleep(0.5)  # the pump writes batches meanwhile
    os.rmdir(directory)
    """
)


def _run_producer(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


def _run_many(tmp_path: Path, source: str) -> None:
    script = tmp_path / "producer.py"
    script.write_text(source)
    # Two or more at once: each run is mostly interpreter start-up, and the load is part of the test.
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        runs = list(pool.map(_run_producer, [script] * RUNS))
    failed = [(run.returncode, run.stderr[-2000:]) for run in runs if run.returncode != 0]
    assert failed == [], f"{len(failed)} of {RUNS} producers failed: {failed[:3]}"


def test_a_table_producer_exits_with_status_0_after_its_publisher_closed(tmp_path: Path) -> None:
    _run_many(tmp_path, _TABLE_PRODUCER)


def test_a_stream_producer_exits_with_status_0_after_its_publisher_closed(tmp_path: Path) -> None:
    _run_many(tmp_path, _STREAM_PRODUCER)
