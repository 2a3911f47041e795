"""A forked child inherits a publisher, a session and imports: it may read the data, but neither
uses nor breaks its parent's bridge.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import functools
import gc
import os
from typing import Any

import pyarrow as pa
import pytest
from helpers.session_rig import report_from_forked_child, sample_table, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.runtime import reaper

pytestmark = pytest.mark.usefixtures("no_leaks")


def _forked_child(parent_objects: dict[str, Any], path: str) -> list[Any]:
    """The body of test_a_forked_child_neither_uses_nor_breaks_its_parents_bridge's child: its
    report. ``parent_objects`` holds what the child inherited."""
    session, pub, held = parent_objects["session"], parent_objects["pub"], parent_objects["held"]
    report: list[Any] = [pa.table(held).num_rows]  # inherited data stays readable
    for call in (lambda: session.get("t"), session.list, lambda: pub.publish("u", sample_table(1))):
        try:
            call()
            report.append("no error")
        except aib.ClosedError:
            report.append("foreign")
    # Dropping and closing everything inherited must reach nothing of the parent's.
    held.release()
    parent_objects.clear()
    gc.collect()
    reaper.settle()
    session.close()
    pub.close()
    with aib.connect(path, timeout=5.0) as own, own.get("t") as imported:  # its own session works
        report.append(pa.table(imported).num_rows)
    return report


def test_a_forked_child_neither_uses_nor_breaks_its_parents_bridge(sock_dir: str) -> None:
    """A child of fork inherits a publisher, a session, their sockets and imports. It may read the
    imports, but the session and publisher raise ClosedError there, and dropping or closing
    them in the child sends no frame, shuts no socket down and unlinks no file: the parent's leases,
    connection and socket file are untouched. A new session made in the child works."""
    with aib.Publisher(os.path.join(sock_dir, "fork.sock")) as pub:
        pub.publish("t", sample_table(100))
        session = aib.connect(pub.path, timeout=5.0)
        held = session.get("t")
        other = session.get("t")
        assert pub.active_leases == 2
        # Dropped after the call, so that `del other` below lets the parent's last reference go.
        inherited = {"session": session, "pub": pub, "held": held, "other": other}
        report = report_from_forked_child(functools.partial(_forked_child, inherited, pub.path))
        del inherited
        assert report == [100, "foreign", "foreign", "foreign", 100]
        assert os.path.exists(pub.path)
        assert pub.active_leases == 2  # the child's new session came and went; ours stand
        with session.get("t") as again:
            assert pa.table(again).num_rows == 100
        held.release()
        del other  # ends through the reaper thread, whose wake-ups the child did not take
        assert wait_for(lambda: pub.active_leases == 0, 5.0)
        session.close()
