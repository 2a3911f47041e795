"""Pairs of GPUs in one process: can one read the other's memory, turning that on, copies between them.

A kernel on GPU ``reader`` may dereference memory of GPU ``owner`` only once the reader's context has enabled
peer access to the owner's (``cuCtxEnablePeerAccess``), which the driver allows only when the hardware has a
peer path between the two (``cuDeviceCanAccessPeer``: NVLink, or PCIe under a switch that routes peer
traffic). :func:`enable_peer_access` does it once per ordered pair and process (the driver answers a second
call with an error, and enabling maps every allocation of the owner into the reader, so it is not free), under
a lock; a pair without a peer path raises :class:`~arrow_ipc_bridge.errors.CudaError`
(``reason="no_peer_access"``) naming both GPUs. :func:`copy_peer_async` is one ``cuMemcpyPeerAsync``:
asynchronous on the caller's stream, direct over the peer path when there is one, staged by the driver
otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from arrow_ipc_bridge.cuda._declarations import (
    CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED,
    CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED,
    CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
    CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK,
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    CUDA_SUCCESS,
)
from arrow_ipc_bridge.cuda._driver import (
    _DRIVER,
    _address,
    _api,
    _check,
    _nbytes,
    _stream_value,
)
from arrow_ipc_bridge.cuda.devices import (
    _device,
    _primary_context,
    device_context,
    device_count,
    device_uuid,
    format_uuid,
)
from arrow_ipc_bridge.errors import CudaError

__all__ = [
    "is_no_peer_access",
    "PeerLink",
    "access_matrix",
    "can_access_peer",
    "copy_peer_async",
    "enable_peer_access",
    "peer_access_enabled",
    "peer_access_error",
    "peer_link",
    "try_enable_peer_access",
]


@dataclasses.dataclass(frozen=True, slots=True)
class PeerLink:
    """What GPU ``reader`` can do with GPU ``owner``'s memory (``cuDeviceGetP2PAttribute``, one direction)."""

    reader: int
    owner: int
    #: the hardware has a peer path: ``cuCtxEnablePeerAccess`` will succeed
    access_supported: bool
    #: the driver's relative rank of the link (higher is faster; only comparable within one host)
    performance_rank: int
    #: atomic operations on the owner's memory run natively over the link
    native_atomics: bool
    #: CUDA arrays (textures) of the owner can be read over the link
    cuda_array_access: bool


# Ordered pairs (reader, owner) whose access this process enabled, or found enabled by someone else
# (CuPy and PyTorch enable it too, on the same primary contexts). Never disabled: an array in use
# may depend on it at any time, and the driver keeps it until the context is destroyed.
_ENABLED: set[tuple[int, int]] = set()
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # CUDA is unusable in a forked child (``_driver``): it starts with nothing enabled.
    global _LOCK
    _LOCK = threading.Lock()
    _ENABLED.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _ordinal(value: Any, what: str) -> int:
    """A device ordinal argument, checked before any driver call (``_device`` checks the range)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a device ordinal (int), not {type(value).__name__}")
    return value


def _gpu_name(ordinal: int) -> str:
    """``GPU 1 (GPU-6f1c...)``: this process's ordinal and the UUID every process agrees on."""
    try:
        return f"GPU {ordinal} ({format_uuid(device_uuid(ordinal))})"
    except CudaError:  # the error being reported matters more than its decoration
        return f"GPU {ordinal}"


def _uuid_or_none(ordinal: int) -> str | None:
    try:
        return format_uuid(device_uuid(ordinal))
    except CudaError:
        return None


def is_no_peer_access(exc: BaseException) -> bool:
    """Whether ``exc`` says that a pair of GPUs has no peer path (made by :func:`peer_access_error`)."""
    return isinstance(exc, CudaError) and exc.reason == "no_peer_access"


def peer_access_error(
    reader: int,
    owner: int,
    why: str,
    *,
    call: str | None = None,
    code: int | None = None,
    name: str | None = None,
) -> CudaError:
    """The :class:`~arrow_ipc_bridge.errors.CudaError` (``reason="no_peer_access"``) for a pair,
    naming both GPUs; ``why`` says why (and what to do). The details ``reader``, ``owner``
    (ordinals), ``reader_uuid``, ``owner_uuid`` and the driver's ``call`` / ``code`` / ``name``
    (``None`` when the driver was not asked because it reported no peer path) say the same for a
    handler. A copy (``imported.to_device(reader)``) works between any two GPUs."""
    return CudaError(
        f"{_gpu_name(reader)} cannot read the memory of {_gpu_name(owner)} in place: {why}",
        reason="no_peer_access",
        call=call,
        code=code,
        name=name,
        reader=reader,
        owner=owner,
        reader_uuid=_uuid_or_none(reader),
        owner_uuid=_uuid_or_none(owner),
    )


def can_access_peer(reader: int, owner: int) -> bool:
    """Whether GPU ``reader`` can be given access to GPU ``owner``'s memory (``cuDeviceCanAccessPeer``).

    True for ``reader == owner``. Nothing is enabled: see :func:`enable_peer_access`.

    Parameters
    ----------
    reader, owner : int
        Device ordinals in this process.
    """
    reader, owner = _ordinal(reader, "reader"), _ordinal(owner, "owner")
    reader_dev, owner_dev = _device(reader), _device(owner)
    if reader == owner:
        return True
    lib, ffi = _api()
    out = ffi.new("int *")
    _check("cuDeviceCanAccessPeer", lib.cuDeviceCanAccessPeer(out, reader_dev, owner_dev))
    return bool(out[0])


def peer_link(reader: int, owner: int) -> PeerLink:
    """What GPU ``reader`` can do with GPU ``owner``'s memory: :class:`PeerLink` (four driver queries).

    Parameters
    ----------
    reader, owner : int
        Two different device ordinals in this process.
    """
    reader, owner = _ordinal(reader, "reader"), _ordinal(owner, "owner")
    if reader == owner:
        raise ValueError(f"a peer link joins two different GPUs; got GPU {reader} twice")
    reader_dev, owner_dev = _device(reader), _device(owner)
    lib, ffi = _api()
    out = ffi.new("int *")

    def attribute(which: int) -> int:
        _check("cuDeviceGetP2PAttribute", lib.cuDeviceGetP2PAttribute(out, which, reader_dev, owner_dev))
        return int(out[0])

    return PeerLink(
        reader=reader,
        owner=owner,
        access_supported=bool(attribute(CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)),
        performance_rank=attribute(CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK),
        native_atomics=bool(attribute(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)),
        cuda_array_access=bool(attribute(CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED)),
    )


def peer_access_enabled(reader: int, owner: int) -> bool:
    """Whether this process enabled (or found enabled) GPU ``reader``'s access to GPU ``owner``;
    True for one GPU with itself. Asks no driver."""
    return reader == owner or (reader, owner) in _ENABLED


def enable_peer_access(reader: int, owner: int) -> None:
    """Let kernels and copies on GPU ``reader`` read and write GPU ``owner``'s memory in place.

    ``cuCtxEnablePeerAccess`` from the reader's primary context (the one CuPy and PyTorch use) to the
    owner's, once per ordered pair and process; later calls return at once. Access that another
    library enabled already counts as enabled. Nothing to do when ``reader == owner``. The access
    covers legacy (``cudaMalloc``) allocations of the owner, those opened from IPC handles included;
    IPC-pool and VMM memory have access of their own (``cuda/cross_gpu.py`` grants it).

    Parameters
    ----------
    reader, owner : int
        Device ordinals in this process.

    Raises
    ------
    CudaError (``reason="no_peer_access"``)
        The two GPUs have no peer path (``cuDeviceCanAccessPeer`` says 0), or the driver refused
        (too many peers, ...): the message names both GPUs by ordinal and UUID.
    CudaError
        An ordinal this process does not see.
    """
    reader, owner = _ordinal(reader, "reader"), _ordinal(owner, "owner")
    if reader == owner or (reader, owner) in _ENABLED:
        _device(reader)  # a bad ordinal still fails, even on the fast path
        return
    with _LOCK:
        if (reader, owner) in _ENABLED:
            return
        if not can_access_peer(reader, owner):
            raise peer_access_error(
                reader,
                owner,
                "the driver reports no peer path between them (cuDeviceCanAccessPeer = 0: no NVLink, "
                "and PCIe peer traffic is not routed between them). Copy the data instead: "
                f"imported.to_device({reader}), or Session(reader_device={reader}, cross_device='copy')",
            )
        rc = _enable_from(reader, owner)
        if rc not in (CUDA_SUCCESS, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            error = _DRIVER.error("cuCtxEnablePeerAccess", rc)
            raise peer_access_error(
                reader,
                owner,
                f"{error.message}. Copy the data instead: imported.to_device({reader})",
                call="cuCtxEnablePeerAccess",
                code=rc,
                name=error.details.get("name"),
            )
        _ENABLED.add((reader, owner))


def _enable_from(reader: int, owner: int) -> int:
    """``cuCtxEnablePeerAccess`` with the reader's primary context current; the driver's code."""
    lib, _ = _api()
    peer = _primary_context(owner)
    with device_context(reader):
        return int(lib.cuCtxEnablePeerAccess(peer, 0))


def try_enable_peer_access(reader: int, owner: int) -> bool:
    """Enable access like :func:`enable_peer_access` where the pair has a peer path; False (nothing
    raised) where it has none: for copies, which work either way and only run faster with it."""
    try:
        enable_peer_access(reader, owner)
    except CudaError as exc:
        if not is_no_peer_access(exc):
            raise
        return False
    return True


def copy_peer_async(
    dst: int, dst_device: int, src: int, src_device: int, nbytes: int, *, stream: object = 0
) -> None:
    """Queue one copy of ``nbytes`` from ``src`` on GPU ``src_device`` to ``dst`` on GPU ``dst_device``.

    ``cuMemcpyPeerAsync`` between the two primary contexts, ordered on ``stream`` (a stream of
    ``dst_device``; 0 is its legacy default stream); the host does not wait. Direct over NVLink or
    PCIe when the pair's peer access is enabled (:func:`enable_peer_access`), staged through host
    memory by the driver otherwise. Works for ``dst_device == src_device`` too.

    Parameters
    ----------
    dst, src : int
        Device addresses in this process.
    dst_device, src_device : int
        Their GPUs' ordinals.
    nbytes : int
        Bytes to copy (0: nothing is queued).
    stream : int or stream object
        A ``CUstream`` of ``dst_device`` or a CuPy / PyTorch stream.
    """
    dst, src = _address(dst, "dst"), _address(src, "src")
    nbytes = _nbytes(nbytes)
    dst_device, src_device = _ordinal(dst_device, "dst_device"), _ordinal(src_device, "src_device")
    stream_value = _stream_value(stream)
    if nbytes == 0:
        return
    lib, ffi = _api()
    s = ffi.cast("CUstream", stream_value)
    dst_ctx, src_ctx = _primary_context(dst_device), _primary_context(src_device)
    with device_context(dst_device):
        _check("cuMemcpyPeerAsync", lib.cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, s))


def access_matrix() -> list[list[bool]]:
    """``can_access_peer(reader, owner)`` for every pair of this process's GPUs, rows by reader."""
    count = device_count()
    return [[can_access_peer(reader, owner) for owner in range(count)] for reader in range(count)]
