"""This process's id, kept current across ``fork`` without a system call per check.

Sessions, publishers and connections belong to the process that made them (a child of ``fork``
inherits them but must not use them: see ``errors.ClosedError``, ``reason="forked"``). They compare their
creator's pid with :data:`pid` on every use, including every ``get``; ``os.getpid()`` is a system
call, this is an attribute read.
"""

from __future__ import annotations

import os

from arrow_ipc_bridge.errors import ClosedError

pid = os.getpid()


def foreign(what: str, owner_pid: int, advice: str) -> ClosedError:
    """The error for ``what`` (made by process ``owner_pid``) used in this process, a fork child."""
    return ClosedError(
        f"this {what} belongs to process {owner_pid}, not to this one ({os.getpid()}, a child of "
        f"fork): {advice}",
        what=what,
        reason="forked",
    )


def _after_fork_in_child() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)
