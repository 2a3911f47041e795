"""The producer's copy path: buffers that cannot be shared go into one memfd, sealed before it leaves.

Each buffer lands at a 64-byte aligned offset (Arrow's recommended alignment); the memfd is then sealed
against shrink, grow and write, so a consumer can verify the producer can never truncate it under its mapping
(which would SIGBUS the reader) nor change the bytes it reads, and reopened read-only: the descriptor that
leaves has no write access.
"""

from __future__ import annotations

import array
import errno
import fcntl
import os
from typing import Final

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.errors import InvalidArgumentError, RegionError
from arrow_ipc_bridge.host._system import reopen_read_only

__all__ = ["BUFFER_ALIGNMENT", "FULL_SEALS"]

#: Alignment of each buffer inside a copy region (Arrow's recommended buffer alignment).
BUFFER_ALIGNMENT: Final = 64
#: Seals of a copy region: the consumer may rely on the bytes and the size never changing.
FULL_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def _copy_to_memfd(items: list[tuple[int, int]]) -> tuple[int, int, list[int]]:
    """Copy the buffers into one new sealed memfd at 64-byte aligned offsets; return (fd, size, offsets).

    The bytes go in with pwritev(2) (one syscall for up to 512 buffers, padding written from a static zero
    block) rather than mmap + memmove. It is the faster of the two for large buffers (a fresh memfd page
    written through a mapping is first zero-filled by the fault, then copied over; a whole-page write skips
    both the zeroing and the fault) and for many small ones (one syscall, no Python object per buffer).
    There is also no writable mapping to unmap before F_SEAL_WRITE, and an unreadable source address fails
    with EFAULT instead of crashing the process.
    """
    offsets: list[int] = []
    iov = array.array("Q")  # struct iovec[] on LP64: (base, length) pairs
    total = 0
    for address, nbytes in items:
        offsets.append(total)
        pad = -nbytes % BUFFER_ALIGNMENT
        iov.extend((address, nbytes, _ZEROS_ADDRESS, pad) if pad else (address, nbytes))
        total += nbytes + pad
    fd = os.memfd_create("aib-copy", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        _write_iov(fd, iov)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, FULL_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return reopen_read_only(fd), total, offsets


_ZEROS = ffi.new("char[]", BUFFER_ALIGNMENT)  # source of the padding between buffers
_ZEROS_ADDRESS: Final = int(ffi.cast("uintptr_t", _ZEROS))
_IOV_MAX: Final = 1024  # Linux UIO_MAXIOV


def _write_iov(fd: int, iov: array.array[int]) -> None:
    """Write the (base, length) pairs back to back from file offset 0, in batches of _IOV_MAX entries."""
    offset = 0
    error = ffi.new("int *")
    for first in range(0, len(iov), 2 * _IOV_MAX):
        batch = iov[first : first + 2 * _IOV_MAX]
        expected = sum(batch[1::2])
        written = lib.aib_sys_pwritev(
            fd, ffi.cast("uint64_t *", ffi.from_buffer(batch)), len(batch) // 2, offset, error
        )
        if written != expected:
            # Error (-1), or a short write: at most 0x7ffff000 bytes go per call, and a signal can cut one.
            # Finish buffer by buffer from where it stopped; a bad address then fails naming itself.
            done = max(written, 0)
            for k in range(0, len(batch), 2):
                base, length = batch[k], batch[k + 1]
                if done < length:
                    _pwrite_all(fd, base + done, length - done, offset + done)
                offset += length
                done = max(done - length, 0)
            continue
        offset += expected


def _pwrite_all(fd: int, address: int, nbytes: int, offset: int) -> None:
    view = memoryview(ffi.buffer(ffi.cast("char *", address), nbytes))
    done = 0
    try:
        while done < nbytes:
            done += os.pwrite(fd, view[done:], offset + done)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise InvalidArgumentError(
                f"buffer at {address:#x} ({nbytes} bytes) is not readable memory of this process "
                f"(EFAULT at byte {done})",
                address=address,
                nbytes=nbytes,
            ) from exc
        raise RegionError(f"could not copy {nbytes} bytes into a memfd: {exc}", nbytes=nbytes) from exc
    finally:
        view.release()
