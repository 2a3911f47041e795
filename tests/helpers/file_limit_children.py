"""Children for tests/test_file_limit.py, started with ``spawn``: each lowers its own
``RLIMIT_NOFILE`` (the test runner's stays as it was), runs into it and reports what it saw as a
dict of plain values through ``conn``."""

from __future__ import annotations

import os
import resource
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib

TABLE = pa.table({"x": pa.array([1, 2, 3], pa.int64())})


def open_fds(limit: int) -> list[int]:
    """The descriptor numbers open now, found without opening one (``fstat`` of each number
    below the limit): it works at the limit, where listing ``/proc/self/fd`` would fail."""
    found = []
    for fd in range(limit):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found


def error_facts(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "is_os_error": isinstance(exc, OSError),
        "is_bridge_error": isinstance(exc, aib.BridgeError),
        "errno": getattr(exc, "errno", None),
        "soft": getattr(exc, "soft", None),
        "hard": getattr(exc, "hard", None),
    }


def lower_limit(soft: int) -> tuple[int, int]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft, hard


def publish_until_limit_main(conn: Any, path: str, soft: int) -> None:
    """Publish host tables (each a sealed memfd copy) until the limit; then: the same publish again
    and a republish of a served name (both must fail and change nothing), and recovery after
    unpublishing (a session gets a served name; publishing works again)."""
    report: dict[str, Any] = {"limit": lower_limit(soft)}
    with aib.Publisher(path) as pub:
        published = 0
        try:
            while published < soft:
                pub.publish(f"n{published}", TABLE)
                published += 1
        except BaseException as exc:
            report["error"] = error_facts(exc)
        report["published"] = published
        failed = f"n{published}"
        # Again, at the limit: nothing may change, no descriptor may stay open.
        state = (pub.names(), pub.version("n0"), open_fds(soft))
        for name in (failed, "n0"):  # a new name, then replacing a served one
            try:
                pub.publish(name, TABLE)
                report[f"again {name}"] = None
            except BaseException as exc:
                report[f"again {name}"] = error_facts(exc)
        report["unchanged"] = state == (pub.names(), pub.version("n0"), open_fds(soft))
        report["failed version"] = pub.version(failed)
        # Recovery: unpublished names without leases give their descriptors back.
        for i in range(4):
            pub.unpublish(f"n{i}")
        with aib.connect(pub.path) as session, session.get(f"n{published - 1}") as imported:
            report["got"] = pa.table(imported).equals(TABLE)
        pub.publish(failed, TABLE)
        report["published after unpublish"] = pub.version(failed) > 0
    conn.send(report)


def zero_copy_and_export_main(conn: Any, soft: int) -> None:
    """At the limit: allocate_shared; a zero-copy export with copy="never" (reopening its memfd needs
    a descriptor: the error must say so, not CopyRequiredError); aib.export of heap data."""
    report: dict[str, Any] = {"limit": lower_limit(soft)}
    buffers = []
    try:
        while len(buffers) < soft:
            buffers.append(aib.allocate_shared(4096))
    except BaseException as exc:
        report["allocate_shared"] = error_facts(exc)
    report["allocations"] = len(buffers)
    shared = pa.Array.from_buffers(pa.int64(), 8, [None, buffers[0].as_pyarrow()])
    before = open_fds(soft)
    for what, call in (
        ("export never", lambda: aib.export(shared, copy="never")),
        ("export if_needed", lambda: aib.export(TABLE)),
    ):
        try:
            call().close()
            report[what] = None
        except BaseException as exc:
            report[what] = error_facts(exc)
    report["unchanged"] = before == open_fds(soft)
    for buffer in buffers[:2]:
        buffer.close()
    with aib.export(shared, copy="never") as exported:  # a descriptor is free again: zero-copy works
        report["zero copy after close"] = exported.stats.zero_copy_regions
    conn.send(report)
