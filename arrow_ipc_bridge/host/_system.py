"""What the host-memory modules share of the operating system: the page size, closing fds.

Private to :mod:`arrow_ipc_bridge.host`; the names keep their leading underscore because no code outside the
package should use them.
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


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment
