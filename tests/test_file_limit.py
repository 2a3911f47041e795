"""Running out of file descriptors (``RLIMIT_NOFILE``) is a ``LimitError`` that says what to do.

A host publication holds one descriptor per region while it is published or leased
(``docs/api.md``, "File descriptors"), so a producer that publishes many names reaches the limit.
Each test runs in a spawned child that lowers its own soft limit (this process's stays as it was)
and reports what it saw: the error's type and facts, whether anything changed or leaked, and that
the process recovers once descriptors are given back.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
from typing import Any

import pytest
from helpers import file_limit_children

SPAWN = mp.get_context("spawn")
SOFT = 96  # enough for the interpreter, pyarrow and a publisher; small enough to reach quickly


def run_child(target: Any, *args: Any) -> dict[str, Any]:
    parent, child = SPAWN.Pipe()
    process = SPAWN.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    child.close()
    try:
        assert parent.poll(120.0), "the child did not report"
        report: dict[str, Any] = parent.recv()
    finally:
        process.join(30.0)
        if process.is_alive():
            process.kill()
            process.join()
        parent.close()
    assert process.exitcode == 0
    return report


def assert_file_limit_error(
    facts: dict[str, Any] | None, limit: list[int] | tuple[int, int], doing: str
) -> None:
    assert facts is not None, f"{doing}: no error at the limit"
    assert facts["type"] == "LimitError", facts
    assert facts["is_bridge_error"]
    assert facts["is_os_error"]
    assert facts["errno"] == errno.EMFILE
    soft, hard = limit
    assert (facts["soft"], facts["hard"]) == (soft, hard)
    message = facts["message"]
    assert message.startswith(doing), message
    assert f"soft limit {soft}" in message
    assert "ulimit -n" in message
    assert "resource.setrlimit(resource.RLIMIT_NOFILE" in message


def test_publishing_past_the_limit_is_reported_and_changes_nothing(sock_dir: str) -> None:
    report = run_child(file_limit_children.publish_until_limit_main, os.path.join(sock_dir, "p.sock"), SOFT)
    published = report["published"]
    assert 0 < published < SOFT  # one descriptor per publication, plus what the process holds
    assert_file_limit_error(report.get("error"), report["limit"], f"publishing 'n{published}'")
    # The same publish again, and replacing a served name: the same error, and nothing changed
    # (names, versions, the descriptors open).
    assert_file_limit_error(report[f"again n{published}"], report["limit"], f"publishing 'n{published}'")
    assert_file_limit_error(report["again n0"], report["limit"], "publishing 'n0'")
    assert report["unchanged"]
    assert report["failed version"] == 0
    # Unpublishing gave descriptors back: a session connects and gets, publishing works again.
    assert report["got"]
    assert report["published after unpublish"]


def test_allocations_and_exports_past_the_limit_are_reported(sock_dir: str) -> None:
    report = run_child(file_limit_children.zero_copy_and_export_main, SOFT)
    limit = report["limit"]
    assert 0 < report["allocations"] < SOFT
    assert_file_limit_error(report["allocate_shared"], limit, "allocate_shared(4096)")
    # Reopening a zero-copy memfd needs a descriptor: that is the error, not CopyRequiredError.
    assert_file_limit_error(report["export never"], limit, "exporting")
    assert_file_limit_error(report["export if_needed"], limit, "exporting")
    assert report["unchanged"]
    assert report["zero copy after close"] == 1


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_the_error_names_the_limit_and_pickles(code: int) -> None:
    import pickle
    import resource

    from arrow_ipc_bridge.runtime.file_limit import file_limit_error, is_out_of_descriptors

    raw = OSError(code, os.strerror(code))
    assert is_out_of_descriptors(raw)
    assert not is_out_of_descriptors(OSError(errno.ENOMEM, "no memory"))
    assert not is_out_of_descriptors(ValueError("x"))
    error = file_limit_error("publishing 'x'", raw)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert (again.errno, again.soft, again.hard, str(again)) == (
        code,
        *resource.getrlimit(resource.RLIMIT_NOFILE),
        str(error),
    )
    assert ("fs.file-max" in str(error)) == (code == errno.ENFILE)
