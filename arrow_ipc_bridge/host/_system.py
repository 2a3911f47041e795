"""What the host-memory modules share of the operating system: the page size, closing fds, read-only reopens.

Private to :mod:`arrow_ipc_bridge.host`; the names keep their leading underscore because no code outside the
package should use them, except :func:`reopen_read_only`, which the package exports.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from typing import Final

_PAGE: Final = mmap.PAGESIZE

# The raw libc calls (mmap/munmap, pwritev, the PROCMAP_QUERY ioctl) are in the C core
# (cffi_build/host_system.c), reached through arrow_ipc_bridge._ffi like every other C call.


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        # Nothing useful to do about EBADF/EIO on close; keep closing the others.
        with contextlib.suppress(OSError):
            os.close(fd)


def reopen_read_only(fd: int) -> int:
    """A new read-only description of ``fd``'s file (through /proc/self/fd), closing ``fd``.

    A sealed memfd is sent out read-only: its seals already stop every write, but the descriptor a
    peer receives then says so itself (docs/security.md), and holds no write access should a seal
    ever be missing. On failure ``fd`` is closed too and the error raised.
    """
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment
