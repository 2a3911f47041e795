"""The consumer's import of a message's regions: host files mapped, CUDA handles opened.

:class:`~arrow_ipc_bridge.consumer.session.Session` decodes a message and checks it; these functions make its
regions addressable in this process, make the import (and the template that remembers the message,
when it is remembered) hold what keeps each region open, and build the imported object. They take
what they need from the session as arguments, so this module knows nothing of connections.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.consumer.content_check import check_content, cuda_reader
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, imported_from
from arrow_ipc_bridge.consumer.remembered import RememberedMessages, needs_lease
from arrow_ipc_bridge.errors import InvalidArgumentError, ProtocolError
from arrow_ipc_bridge.host.mappings import HostMappingCache
from arrow_ipc_bridge.runtime import arguments
from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA
from arrow_ipc_bridge.wire.metadata import (
    REGION_CUDA_LEGACY,
    REGION_CUDA_POOL,
    REGION_FLAG_ZERO_COPY,
    REGION_HOST_FD,
    Decoded,
    DeviceInfo,
    Region,
)

__all__ = ["checked_fds", "file_identities", "hold", "map_host_regions", "open_cuda_regions"]

Imported = ImportedArray | ImportedStream


def map_host_regions(
    cache: HostMappingCache, decoded: Decoded, fds: Sequence[int], template: Decoded
) -> list[int]:
    """Maps every region; ``decoded`` (the import) and ``template`` (kept if the message is
    remembered) each hold every mapping."""
    bases: list[int] = []
    for region in decoded.regions():
        if region.kind != REGION_HOST_FD or region.fd_index < 0:
            raise ProtocolError(f"region kind {region.kind} cannot be imported into host memory")
        mapped = cache.map(fds[region.fd_index], region, cacheable=bool(region.flags & REGION_FLAG_ZERO_COPY))
        hold(mapped.owner, decoded, template)
        bases.append(mapped.base)
    return bases


def open_cuda_regions(
    template: Decoded,
    decoded: Decoded,
    regions: list[Region],
    fds: Sequence[int],
    device: DeviceInfo,
    *,
    name: str | None,
    lease_owner: Any,
    remembered: RememberedMessages,
    cuda_check: str,
    fetch_pool_fd: Callable[[bytes], int] | None,
) -> tuple[Imported, bool]:
    """Opens the regions (held by ``decoded``'s owner). Messages whose regions can stay open are
    also remembered, with ``template`` holding them: all-legacy ones, and IPC-pool ones when
    ``lease_owner`` (this get's lease, see RememberedMessages.keeps_pool_lease) is given, which
    the template then keeps too. ``remembered``: the session's remembered messages;
    ``cuda_check``: its content check level for CUDA data; ``fetch_pool_fd``: asks the publisher
    for a pool's fd that the message left out (None: not connected). Returns the import and
    whether the template was kept."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import opener as cuda_regions  # the consumer's side of CUDA regions

    # The producer's GPU, by UUID, in this process's numbering (CUDA_VISIBLE_DEVICES may differ).
    ordinal = cuda.ordinal_for_uuid(device.identity)
    opener = cuda_regions.opener()
    fd_list = list(fds)
    bases = [0] * len(regions)
    # Legacy handles and kept pool slabs stay open beyond a lease (the opener's LRUs); other
    # pool imports only under a lease.
    pool_indexes = [i for i, r in enumerate(regions) if r.kind == REGION_CUDA_POOL]
    remember = all(r.kind in (REGION_CUDA_LEGACY, REGION_CUDA_POOL) for r in regions) and (
        not needs_lease(regions) or lease_owner is not None
    )
    if pool_indexes:  # imported together: per buffer this is near the driver's own cost
        pool_bases, pool_owner = opener.open_pool_regions(
            [regions[i] for i in pool_indexes],
            fd_list,
            ordinal,
            fetch_pool_fd,
        )
        if lease_owner is not None:
            try:
                # The lease's owner holds the imports, so they are freed (reaper order: its
                # dependencies first) before the lease is given back and the producer may free.
                if lib.aib_owner_add_dependency(lease_owner, pool_owner):
                    raise MemoryError("adding an owner dependency")
                template.depend_on(lease_owner)
            finally:
                lib.aib_owner_unref(pool_owner)
        else:  # kept slabs only, when remembered: held like legacy handles
            hold(pool_owner, decoded, template if remember else None)
        for i, base in zip(pool_indexes, pool_bases, strict=True):
            bases[i] = base
    legacy_indexes = [i for i, r in enumerate(regions) if r.kind == REGION_CUDA_LEGACY]
    if legacy_indexes:  # opened together, held by one owner
        legacy_bases, legacy_owner = opener.open_legacy_regions([regions[i] for i in legacy_indexes], ordinal)
        hold(legacy_owner, decoded, template if remember else None)
        for i, base in zip(legacy_indexes, legacy_bases, strict=True):
            bases[i] = base
    for i, region in enumerate(regions):
        if region.kind in (REGION_CUDA_POOL, REGION_CUDA_LEGACY):
            continue
        opened = opener.open(region, fd_list, ordinal)
        hold(opened.owner, decoded, template if remember else None)
        bases[i] = opened.base
    base_array = ffi.new("uint64_t[]", bases or [0])
    if cuda_check != "none":  # reads device memory: only when asked for
        check_content(decoded, base_array, cuda_check, cuda_reader(ordinal))
    event = cuda_regions.open_event(device.sync, ordinal) if device.sync else 0
    if remember:
        remembered.remember(
            template,
            base_array,
            DEVICE_CUDA,
            ordinal,
            event,
            files=None,  # the regions are named by the message; pool fds matter only once
            name=name,
            lingers=lease_owner is not None,
        )
    sync = None
    if event:
        sync = cuda_regions.owner_slot(decoded.owner)
        sync[0] = event
    imported = imported_from(
        decoded, base_array, device_type=DEVICE_CUDA, device_id=ordinal, sync_event=sync, name=name
    )
    return imported, remember


def hold(owner: Any, decoded: Decoded, template: Decoded | None) -> None:
    """Make the import (and the template that remembers the message, if any) hold ``owner``, what
    keeps a region open; the caller's reference goes."""
    try:
        decoded.depend_on(owner)
        if template is not None:
            template.depend_on(owner)
    finally:
        lib.aib_owner_unref(owner)


def checked_fds(fds: Sequence[int]) -> Sequence[int]:
    """``fds`` when each is a descriptor number: ``TypeError`` for anything but an int,
    :class:`RegionError` for a number no descriptor can have."""
    if type(fds) is not list and type(fds) is not tuple and not isinstance(fds, Sequence):
        arguments.fail_type("fds", "a sequence of file descriptors (ints)", fds)
    for fd in fds:
        if isinstance(fd, bool) or not isinstance(fd, int):
            arguments.fail_type("fds", "a sequence of file descriptors (ints)", fd)
        if not 0 <= fd < 2**31:
            raise InvalidArgumentError(f"fds: {fd} is not a file descriptor number", argument="fds")
    return fds


def file_identities(fds: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """(st_dev, st_ino) of each descriptor; None when one cannot be examined (then nothing matches,
    and the import reports the descriptor)."""
    try:
        stats = [os.fstat(fd) for fd in fds]
    except OSError:
        return None
    return tuple((st.st_dev, st.st_ino) for st in stats)
