"""The reaper thread: owners that die in C reach Python through it (``_reaper.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A process that already holds more than FD_SETSIZE (1024) descriptors when the reaper starts gets a
# reaper pipe numbered above 1024. The child checks that releases still reach the publisher then.
_MANY_FDS_CHILD = textwrap.dedent(
    """
    import os, resource, sys, tempfile, time
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        print("SKIP hard RLIMIT_NOFILE", hard)
        sys.exit(0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    import pyarrow as pa
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge import _reaper
    path = os.path.join(tempfile.mkdtemp(), "p.sock")
    with aib.Publisher(path) as pub:
        pub.publish("t", pa.table({"x": pa.array(range(1000))}))
        with aib.connect(path, timeout=10) as session:
            with session.get("t") as imported:
                assert pa.table(imported).num_rows == 1000
            deadline = time.monotonic() + 10
            while pub.active_leases and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pub.active_leases == 0, pub.active_leases
    assert _reaper._thread is not None and _reaper._thread.is_alive()
    print("OK")
    """
)


def test_reaper_runs_in_a_process_with_more_than_1024_descriptors() -> None:
    """The reaper waits with poll, so a descriptor number above FD_SETSIZE does not kill it and
    leases are still given back."""
    result = subprocess.run(
        [sys.executable, "-c", _MANY_FDS_CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("SKIP"):
        pytest.skip(f"cannot raise the descriptor limit: {result.stdout.strip()}")
    assert result.stdout.strip().endswith("OK"), result.stdout + result.stderr
