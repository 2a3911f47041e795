"""``allocate_shared``: bridge-owned memfd memory that exports zero-copy, its registry and its write seal.

The registry (start address -> memfd) lets the producer's placement recognise this memory without reading
/proc; the seals (shrink, grow, future write) make the owner's one writable mapping the only way to write it.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import os
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.errors import ClosedError, RegionError
from arrow_ipc_bridge.host._system import _PAGE, _align_up
from arrow_ipc_bridge.host.counters import _count
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.runtime.file_limit import file_limit_error, is_out_of_descriptors

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["SharedHostBuffer", "allocate_shared", "F_SEAL_FUTURE_WRITE"]

# F_SEAL_FUTURE_WRITE (Linux 5.1; <linux/fcntl.h> 0x0010, missing from the fcntl module before Python 3.12):
# write(), fallocate hole punching and *new* writable shared mappings fail with EPERM for every fd of the
# file, while mappings that already exist stay writable.
F_SEAL_FUTURE_WRITE: Final = int(getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010))
# allocate_shared() memory: the size is fixed (a consumer's mapping can never SIGBUS from a truncation) and
# the owner's one writable mapping, made before the seal, is the only way to write it. Any holder of an fd
# can reopen a memfd read-write through /proc/PID/fd (its inode is mode 0777, whatever the uid), so without
# the write seal every consumer could change the data under the producer and the other consumers.
# F_SEAL_SEAL is left off so a later "freeze" can add F_SEAL_WRITE once the owner's mapping is gone.
_SHARED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE


@dataclass(frozen=True)
class _Registered:
    start: int
    end: int
    fd: int
    dev: int
    inode: int


# RLock: the ffi.gc destructor that unregisters a buffer may run from garbage collection in a thread that is
# inside a registry lookup; a plain Lock would deadlock there.
_registry_lock = threading.RLock()
_registry_starts: list[int] = []
_registry: dict[int, _Registered] = {}


def _after_fork_in_child() -> None:
    # A parent thread may have held the lock at the fork; the child's copy would stay locked. (The
    # registered buffers stay: the child inherited their mappings.) Other modules take the lock as
    # ``shared_alloc._registry_lock``, never a copy of the name, so they see the replacement.
    global _registry_lock
    _registry_lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _registry_lookup(address: int, nbytes: int) -> _Registered | None:
    with _registry_lock:
        k = bisect.bisect_right(_registry_starts, address) - 1
        if k < 0:
            return None
        entry = _registry.get(_registry_starts[k])
    if entry is None or address + nbytes > entry.end:
        return None
    return entry


def _release_shared(start: int, length: int, fd: int, _cdata: Any) -> None:
    """ffi.gc destructor of a SharedHostBuffer's memory: unregister, unmap, close. Must never raise."""
    with _registry_lock:
        if _registry.pop(start, None) is not None:
            del _registry_starts[bisect.bisect_left(_registry_starts, start)]
    lib.aib_sys_munmap(start, length)
    with contextlib.suppress(OSError):
        os.close(fd)


class SharedHostBuffer:
    """A bridge-owned memfd mapping (``MAP_SHARED``, writable by its owner) whose contents export zero-copy.

    Fill it through :meth:`view` or wrap it with :meth:`as_pyarrow` and build arrays on it. The memory stays
    mapped while any view or pyarrow buffer made from it is alive: :meth:`close` only drops this owner's
    reference, so closing can never leave an array pointing at unmapped memory.

    The memfd is sealed against shrink and grow, so a consumer's mapping can never SIGBUS, and with
    ``F_SEAL_FUTURE_WRITE``: the mapping made at allocation (behind :meth:`view` and :meth:`as_pyarrow`) is
    the only way to write it. ``write()`` on :attr:`fd`, new writable mappings and hole punching fail with
    ``EPERM`` for every process, this one included, so no consumer can change the data (a consumer can
    reopen the memfd read-write through /proc, memfd inodes being mode 0777, but cannot write through it).
    The owner's writes stay visible to consumers: the memory is shared, not frozen.
    """

    def __init__(self, keeper: Any, address: int, size: int, fd: int) -> None:
        self._keeper: Any = keeper  # the ffi.gc cdata whose collection unmaps the memory
        self._address = address
        self._size = size
        self._fd = fd

    def _live(self) -> Any:
        if self._keeper is None:
            raise ClosedError("the SharedHostBuffer is closed", what="SharedHostBuffer")
        return self._keeper

    @property
    def address(self) -> int:
        self._live()
        return self._address

    @property
    def size(self) -> int:
        return self._size

    @property
    def fd(self) -> int:
        """The memfd (borrowed: do not close it; exports reopen it read-only)."""
        self._live()
        return self._fd

    @property
    def closed(self) -> bool:
        return self._keeper is None

    def view(self) -> memoryview:
        """A writable memoryview of the memory; it keeps the mapping alive."""
        return memoryview(ffi.buffer(self._live(), self._size))

    def as_pyarrow(self) -> pa.Buffer:
        """The memory as a ``pyarrow.Buffer`` (zero-copy); it keeps the mapping alive."""
        import pyarrow as pa  # lazy: exporting works without importing pyarrow

        return pa.foreign_buffer(self._address, self._size, base=self._live())

    def close(self) -> None:
        """Drop the owner's reference; idempotent. Unmapped once no view or pyarrow buffer uses it."""
        self._keeper = None

    def __enter__(self) -> SharedHostBuffer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"at {self._address:#x}, fd {self._fd}"
        return f"<SharedHostBuffer {self._size} bytes {state}>"


_MEMFD_NAME_MAX = 249
"""The longest memfd name Linux takes (``MFD_NAME_MAX_LEN``: 249 bytes, the 255 of a dentry less
the ``memfd:`` prefix)."""


def _memfd_name_ok(name: str) -> bool:
    try:
        raw = name.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return 0 < len(raw) <= _MEMFD_NAME_MAX and b"\0" not in raw


def allocate_shared(nbytes: int, *, name: str = "aib") -> SharedHostBuffer:
    """Allocate ``nbytes`` of zero-filled shared memory that :func:`export_host_buffers` shares zero-copy.

    ``name`` labels the memfd (it shows as ``/memfd:NAME`` in /proc/PID/maps of both processes).

    Write the memory through the result's :meth:`~SharedHostBuffer.view` or
    :meth:`~SharedHostBuffer.as_pyarrow`; nothing else can write it, consumers included (see
    :class:`SharedHostBuffer`).

    A zero-copy export hands consumers an fd on the *whole* allocation, not only the buffers published: a
    consumer can read every byte of it, including bytes never published (stale data, other arrays built
    in the same allocation). Give data that must not reach a consumer an allocation of its own, or export
    with ``copy="always"``, which sends a sealed copy of the published bytes alone.

    Raises :class:`~arrow_ipc_bridge.errors.InvalidArgumentError` /
    :class:`~arrow_ipc_bridge.errors.InvalidArgumentError` for a size that is not a positive int or a name
    that is not a str of 1 to 249 bytes without NUL, :class:`LimitError` (``limit="file_descriptors"``) when
    no descriptor is left, and :class:`RegionError` for a kernel without ``F_SEAL_FUTURE_WRITE`` (before Linux
    5.1): memory that consumers could write is never handed out.
    """
    nbytes = arguments.count(nbytes, "nbytes", least=1)
    if type(name) is not str:
        arguments.fail_type("name", "a str (the memfd's label)", name)
    if not _memfd_name_ok(name):
        arguments.fail_value("name", f"1 to {_MEMFD_NAME_MAX} bytes without NUL (the memfd's label)", name)
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        if is_out_of_descriptors(exc):
            raise file_limit_error(f"allocate_shared({nbytes})", exc) from exc
        raise RegionError(f"memfd_create({name!r}) failed: {exc}", field="name") from exc
    length = _align_up(nbytes, _PAGE)
    address = 0
    try:
        os.ftruncate(fd, nbytes)
        st = os.fstat(fd)
        error = ffi.new("int *")
        address = int(lib.aib_sys_mmap_shared(fd, length, error))
        if not address:
            raise RegionError(f"mmap of {nbytes} shared bytes failed: {os.strerror(error[0])}", nbytes=nbytes)
        _seal_shared(fd)  # after the mmap: from now on no new writable mapping can be made
    except BaseException:
        if address:
            lib.aib_sys_munmap(address, length)
        os.close(fd)
        raise
    entry = _Registered(address, address + nbytes, fd, st.st_dev, st.st_ino)
    with _registry_lock:
        _registry[address] = entry
        bisect.insort(_registry_starts, address)
    keeper = ffi.gc(ffi.cast("char *", address), lambda cdata: _release_shared(address, length, fd, cdata))
    _count(shared_allocations=1)
    return SharedHostBuffer(keeper, address, nbytes, fd)


def _seal_shared(fd: int) -> None:
    """Add _SHARED_SEALS; RegionError (no fallback) on a kernel without F_SEAL_FUTURE_WRITE (before 5.1)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SHARED_SEALS)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise RegionError(f"sealing the shared memfd failed: {exc}") from exc
        raise RegionError(
            f"this kernel ({os.uname().release}) does not support F_SEAL_FUTURE_WRITE (Linux 5.1+): "
            "allocate_shared memory could not be protected against writes by its consumers, so it is "
            "refused; build the data in ordinary memory and export it with copy='if_needed' or 'always' "
            "(a sealed, counted copy)"
        ) from exc
