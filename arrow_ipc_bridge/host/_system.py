"""What the host-memory modules share of the operating system: libc through cffi, the page size, closing fds.

Private to :mod:`arrow_ipc_bridge.host`; the names keep their leading underscore because no code outside the
package should use them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from typing import Any, Final

import cffi

_PAGE: Final = mmap.PAGESIZE

# --- raw memory access --------------------------------------------------------------------------------------
# cffi in ABI mode (no compiler needed) rather than Python's mmap module: allocate_shared() needs the raw
# address of a MAP_SHARED mapping, and getting it from an mmap.mmap object means holding a buffer export
# (ctypes.c_char.from_buffer / ffi.from_buffer) that makes mmap.close() fail until it is dropped. Calling
# mmap/munmap directly gives a plain address with an explicit unmap, and ffi.gc() ties the unmap to the
# lifetime of one cdata object that pyarrow buffers and memoryviews can hold (see SharedHostBuffer).
_ffi = cffi.FFI()
_ffi.cdef(
    """
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
    int munmap(void *addr, size_t length);
    int ioctl(int fd, unsigned long request, ...);
    struct iovec { void *iov_base; size_t iov_len; };
    ssize_t pwritev(int fd, const struct iovec *iov, int iovcnt, long offset);
    struct procmap_query {
        uint64_t size, query_flags, query_addr;
        uint64_t vma_start, vma_end, vma_flags, vma_page_size, vma_offset, inode;
        uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
        uint64_t vma_name_addr, build_id_addr;
    };
    """
)
_libc: Any = _ffi.dlopen(None)
_MAP_FAILED: Final = _ffi.cast("void *", -1)


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        # Nothing useful to do about EBADF/EIO on close; keep closing the others.
        with contextlib.suppress(OSError):
            os.close(fd)


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment
