"""Running out of file descriptors, reported as what it is and what to do about it.

A host publication holds a descriptor per region (the sealed memfd of copied data, or a read-only reopen of a
zero-copy file) for as long as it is published or leased: a consumer's get sends it, and a memfd has no name
to reopen it by later (``/proc/self/map_files`` needs ``CAP_SYS_ADMIN``), so holding it is the only way to
serve it. Packing publications into shared files instead would let every consumer read the others' bytes and
keep memory that one publication no longer needs (``docs/security.md``). So the limit stays, and reaching it
is detected: the ``OSError`` of ``EMFILE`` (this process's ``RLIMIT_NOFILE``) or ``ENFILE`` (the system's file
table) becomes a :class:`~arrow_ipc_bridge.errors.LimitError` (``limit="file_descriptors"``) that says the
limits and how to raise them.
"""

from __future__ import annotations

import errno
import resource
from typing import TypeGuard

from arrow_ipc_bridge.errors import LimitError

__all__ = ["file_limit_error", "is_out_of_descriptors"]

_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def is_out_of_descriptors(exc: BaseException) -> TypeGuard[OSError]:
    """Whether ``exc`` is an ``OSError`` saying no descriptor was left (``EMFILE``, ``ENFILE``)."""
    return isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS


def file_limit_error(doing: str, exc: OSError) -> LimitError:
    """The :class:`LimitError` (``limit="file_descriptors"``) for ``exc`` (an ``EMFILE`` /
    ``ENFILE`` while ``doing``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    if exc.errno == errno.ENFILE:
        message = (
            f"{doing} needs a file descriptor and the system's file table is full (ENFILE): raise "
            "fs.file-max (sysctl) or close files in other processes; nothing of this attempt was kept"
        )
    else:
        message = (
            f"{doing} needs a file descriptor and this process has all {soft} it may open "
            f"(RLIMIT_NOFILE soft limit {soft}, hard limit {hard_text}; EMFILE). Each host publication "
            "holds one per region until it is unpublished and its leases end. Raise the soft limit, "
            "up to the hard one, before starting the process (`ulimit -n NEW`) or at its start "
            "(`resource.setrlimit(resource.RLIMIT_NOFILE, (NEW, hard))`), or unpublish names no "
            "longer needed; nothing of this attempt was kept"
        )
    return LimitError(message, limit="file_descriptors", value=soft, errno=exc.errno, soft=soft, hard=hard)
