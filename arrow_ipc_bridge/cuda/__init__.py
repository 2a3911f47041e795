"""CUDA memory for the bridge: the driver (through cffi, loaded on first use), IPC kinds, allocators, regions.

One module per concern, dependencies pointing one way (``a <- b``: b imports a)::

    _declarations <- _driver <- devices <- pointers <- legacy_ipc
                                devices <- events, pools, vmm
                                           pools <- slab <- allocators
    the IPC kinds, slab, _state <- placer (producer), opener (consumer)

Importing any of them needs no GPU and no driver. This face re-exports the public names of the driver-level
modules, the allocators and :func:`cuda_stats`; the producer's :mod:`~arrow_ipc_bridge.cuda.placer` and the
consumer's :mod:`~arrow_ipc_bridge.cuda.opener` are imported where they are used.
"""

from arrow_ipc_bridge.cuda._declarations import IPC_HANDLE_SIZE, build_ffi, cdef_source
from arrow_ipc_bridge.cuda._driver import driver_available, driver_version, load_driver
from arrow_ipc_bridge.cuda._state import cuda_stats
from arrow_ipc_bridge.cuda.allocators import CupyPoolAllocator, CupySlabAllocator, cupy_allocator
from arrow_ipc_bridge.cuda.devices import (
    DeviceCapabilities,
    device_attribute,
    device_capabilities,
    device_context,
    device_count,
    device_name,
    device_uuid,
    format_uuid,
    ordinal_for_uuid,
    synchronize,
)
from arrow_ipc_bridge.cuda.events import (
    Event,
    EventPool,
    clear_ipc_event_cache,
    close_ipc_event,
    event_query,
    event_synchronize,
    event_value,
    ipc_event_cache_size,
    open_ipc_event,
    stream_synchronize,
    stream_wait_event,
)
from arrow_ipc_bridge.cuda.legacy_ipc import (
    LegacyHandleCache,
    ipc_close_mem_handle,
    ipc_get_mem_handle,
    ipc_open_mem_handle,
)
from arrow_ipc_bridge.cuda.pointers import (
    PointerInfo,
    mem_alloc,
    mem_free,
    memcpy_dtod,
    memcpy_dtoh,
    memcpy_htod,
    pointer_info,
    read_device,
)
from arrow_ipc_bridge.cuda.pools import ImportedPool, IpcMemoryPool, import_pool, pool_is_ipc_capable
from arrow_ipc_bridge.cuda.slab import SlabAllocator
from arrow_ipc_bridge.cuda.vmm import (
    VmmAllocation,
    VmmMapping,
    vmm_allocate,
    vmm_export_fd,
    vmm_granularity,
    vmm_import,
)

__all__ = [
    # driver and devices
    "driver_available",
    "load_driver",
    "driver_version",
    "device_count",
    "device_name",
    "device_uuid",
    "format_uuid",
    "ordinal_for_uuid",
    "device_attribute",
    "device_capabilities",
    "DeviceCapabilities",
    "device_context",
    "synchronize",
    # pointers and copies
    "PointerInfo",
    "pointer_info",
    "mem_alloc",
    "mem_free",
    "memcpy_dtoh",
    "memcpy_htod",
    "memcpy_dtod",
    "read_device",
    # legacy IPC
    "ipc_get_mem_handle",
    "ipc_open_mem_handle",
    "ipc_close_mem_handle",
    "LegacyHandleCache",
    # events
    "Event",
    "EventPool",
    "open_ipc_event",
    "close_ipc_event",
    "clear_ipc_event_cache",
    "ipc_event_cache_size",
    "stream_wait_event",
    "event_synchronize",
    "event_query",
    "event_value",
    "stream_synchronize",
    # memory pools
    "IpcMemoryPool",
    "ImportedPool",
    "import_pool",
    "pool_is_ipc_capable",
    # allocators
    "cupy_allocator",
    "CupyPoolAllocator",
    "CupySlabAllocator",
    "SlabAllocator",
    # VMM
    "VmmAllocation",
    "VmmMapping",
    "vmm_allocate",
    "vmm_export_fd",
    "vmm_import",
    "vmm_granularity",
    # counters
    "cuda_stats",
    # declarations
    "IPC_HANDLE_SIZE",
    "build_ffi",
    "cdef_source",
]
