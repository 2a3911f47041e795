"""A forked child inherits a publisher, a session and imports: it may read the data, but neither
uses nor breaks its parent's bridge.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import gc
import json
import os
import warnings
from typing import Any

import pyarrow as pa
import pytest
from helpers.session_rig import sample_table, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import _reaper

pytestmark = pytest.mark.usefixtures("no_leaks")


def _forked_child(parent_objects: dict[str, Any], path: str, out: int) -> None:
    """The body of test_a_forked_child_neither_uses_nor_breaks_its_parents_bridge's child: writes
    a JSON report to ``out``. ``parent_objects`` holds what the child inherited."""
    session, pub, held = parent_objects["session"], parent_objects["pub"], parent_objects["held"]
    report: list[Any] = [pa.table(held).num_rows]  # inherited data stays readable
    for call in (lambda: session.get("t"), session.list, lambda: pub.publish("u", sample_table(1))):
        try:
            call()
            report.append("no error")
        except aib.ForeignProcessError:
            report.append("foreign")
    # Dropping and closing everything inherited must reach nothing of the parent's.
    held.release()
    parent_objects.clear()
    gc.collect()
    _reaper.drain()
    session.close()
    pub.close()
    with aib.connect(path, timeout=5.0) as own, own.get("t") as imported:  # its own session works
        report.append(pa.table(imported).num_rows)
    os.write(out, json.dumps(report).encode())


def test_a_forked_child_neither_uses_nor_breaks_its_parents_bridge(sock_dir: str) -> None:
    """A child of fork inherits a publisher, a session, their sockets and imports. It may read the
    imports, but the session and publisher raise ForeignProcessError there, and dropping or closing
    them in the child sends no frame, shuts no socket down and unlinks no file: the parent's leases,
    connection and socket file are untouched. A new session made in the child works."""
    with aib.Publisher(os.path.join(sock_dir, "fork.sock")) as pub:
        pub.publish("t", sample_table(100))
        session = aib.connect(pub.path, timeout=5.0)
        held = session.get("t")
        other = session.get("t")
        assert pub.active_leases == 2
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads running
            pid = os.fork()
        if pid == 0:  # never returns into pytest
            code = 1
            try:
                os.close(read_end)
                _forked_child(
                    {"session": session, "pub": pub, "held": held, "other": other}, pub.path, write_end
                )
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        try:
            _, status = os.waitpid(pid, 0)
            with os.fdopen(read_end, "rb") as reader:
                report = json.loads(reader.read() or b"null")
        finally:
            assert os.waitstatus_to_exitcode(status) == 0
        assert report == [100, "foreign", "foreign", "foreign", 100]
        assert os.path.exists(pub.path)
        assert pub.active_leases == 2  # the child's new session came and went; ours stand
        with session.get("t") as again:
            assert pa.table(again).num_rows == 100
        held.release()
        del other  # ends through the reaper thread, whose wake-ups the child did not take
        assert wait_for(lambda: pub.active_leases == 0, 5.0)
        session.close()
