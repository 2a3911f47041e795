"""CuPy allocators whose arrays the bridge shares without copying: one pool allocation per array, or slabs.

Install one with ``cupy.cuda.set_allocator(cupy_allocator(0))``; with ``slab_size`` the arrays are carved out
of kept slabs (:mod:`arrow_ipc_bridge.cuda.slab`), which a consumer imports once. CuPy is imported only when
an allocator is made.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from arrow_ipc_bridge.cuda._driver import (
    _usable_in_this_process,
)
from arrow_ipc_bridge.cuda.devices import synchronize
from arrow_ipc_bridge.cuda.pools import IpcMemoryPool
from arrow_ipc_bridge.cuda.slab import DEFAULT_SLAB_SIZE, SlabAllocator
from arrow_ipc_bridge.errors import CudaError, InvalidArgumentError

__all__ = [
    "CupyPoolAllocator",
    "CupySlabAllocator",
    "cupy_allocation_request",
    "cupy_allocator",
]


class _PoolAllocationOwner:
    """Keeps one CuPy allocation alive; returns it to the pool when CuPy drops the memory."""

    __slots__ = ("nbytes", "pool", "ptr", "stream")

    def __init__(self, pool: IpcMemoryPool, ptr: int, nbytes: int, stream: int) -> None:
        self.pool = pool
        self.ptr = ptr
        self.nbytes = nbytes
        self.stream = stream

    def __del__(self) -> None:
        try:
            if not _usable_in_this_process():
                return
            try:
                self.pool.free(self.ptr, self.stream)
            except CudaError:
                # The allocating stream is gone: wait for all work on the device, then free on the legacy
                # stream.
                synchronize(self.pool.device)
                self.pool.free(self.ptr, 0)
        except Exception as exc:
            with contextlib.suppress(Exception):  # finalizers never raise
                warnings.warn(
                    f"could not free {self.ptr:#x} to its IPC pool: {exc}", ResourceWarning, stacklevel=2
                )


def cupy_allocation_request(cupy: Any, device: int, nbytes: int) -> tuple[int, int]:
    """What a CuPy allocator call asks for: (bytes, at least 1, since CuPy asks for 0 for empty
    arrays and the driver refuses 0; CuPy's current stream). RegionError when CuPy's current
    device is not the allocator's."""
    current = cupy.cuda.Device().id
    if current != device:
        raise InvalidArgumentError(
            f"CuPy allocates on device {current} but this allocator serves device {device}", argument="device"
        )
    return max(int(nbytes), 1), int(cupy.cuda.get_current_stream().ptr)


class CupyPoolAllocator:
    """A CuPy allocator (for ``cupy.cuda.set_allocator``) that serves memory from an :class:`IpcMemoryPool`.

    Every CuPy array allocated while it is installed lives in an IPC-capable pool, so the bridge shares it at
    pool-import cost instead of copying it. Allocations are ordered on CuPy's current stream and freed on that
    same stream when CuPy releases them.

    Parameters
    ----------
    device : int
        Device ordinal; CuPy's current device must be this one when it allocates.
    pool : IpcMemoryPool, optional
        The pool to serve from; default: a new one for ``device``.
    """

    def __init__(self, device: int = 0, *, pool: IpcMemoryPool | None = None) -> None:
        import cupy  # optional and heavy: only this allocator needs it

        self._cupy: Any = cupy
        self.device = device
        self.pool = pool if pool is not None else IpcMemoryPool(device)

    def __call__(self, nbytes: int) -> Any:
        cupy = self._cupy
        size, stream = cupy_allocation_request(cupy, self.device, nbytes)
        ptr = self.pool.allocate(size, stream)
        owner = _PoolAllocationOwner(self.pool, ptr, size, stream)
        memory = cupy.cuda.UnownedMemory(ptr, size, owner, self.device)
        return cupy.cuda.MemoryPointer(memory, 0)


class _SlabAllocationOwner:
    """Keeps one CuPy allocation; gives its space back to the slab when CuPy drops the memory."""

    __slots__ = ("address", "allocator")

    def __init__(self, allocator: SlabAllocator, address: int) -> None:
        self.allocator = allocator
        self.address = address

    def __del__(self) -> None:
        # Queued, not applied: the collector may run this inside the allocator's own locked section.
        self.allocator.free_later(self.address)


class CupySlabAllocator:
    """A CuPy allocator (``cupy.cuda.set_allocator``) over a :class:`SlabAllocator`: new CuPy arrays
    are carved from kept slabs, so a consumer that imported a slab once imports nothing for them."""

    def __init__(self, device: int = 0, *, slab_size: int = DEFAULT_SLAB_SIZE) -> None:
        import cupy  # optional and heavy: only this allocator needs it

        self._cupy: Any = cupy
        self.device = device
        self.slabs = SlabAllocator(device, slab_size=slab_size)

    @property
    def pool(self) -> IpcMemoryPool:
        return self.slabs.pool

    def __call__(self, nbytes: int) -> Any:
        cupy = self._cupy
        size, stream = cupy_allocation_request(cupy, self.device, nbytes)
        address = self.slabs.allocate(size, stream)
        memory = cupy.cuda.UnownedMemory(
            address, size, _SlabAllocationOwner(self.slabs, address), self.device
        )
        return cupy.cuda.MemoryPointer(memory, 0)


def cupy_allocator(
    device: int = 0, *, pool: IpcMemoryPool | None = None, slab_size: int | None = None
) -> CupyPoolAllocator | CupySlabAllocator:
    """Return an allocator for ``cupy.cuda.set_allocator`` whose allocations are shareable via a pool fd.

    Parameters
    ----------
    device : int
        Device ordinal.
    pool : IpcMemoryPool, optional
        Pool to allocate from; default: a new one (reachable as ``allocator.pool``). Not with
        ``slab_size``.
    slab_size : int, optional
        Carve arrays out of kept slabs of this many bytes (``cuda.slab.SlabAllocator``): a
        consumer imports each slab once, and new arrays in it cost no driver call there; the
        slabs are never freed while this process lives. Default: one pool allocation per array,
        freed when CuPy drops it (each new array is one pointer import per consumer).

    Examples
    --------
    >>> import cupy  # doctest: +SKIP
    >>> cupy.cuda.set_allocator(cupy_allocator(0))  # doctest: +SKIP
    >>> cupy.cuda.set_allocator(cupy_allocator(0, slab_size=256 << 20))  # doctest: +SKIP
    """
    if slab_size is not None:
        if pool is not None:
            raise ValueError("pool and slab_size do not go together: a slab allocator makes its own pool")
        return CupySlabAllocator(device, slab_size=slab_size)
    return CupyPoolAllocator(device, pool=pool)
