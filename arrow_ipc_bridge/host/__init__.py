"""Host memory for the bridge: the producer's regions (zero-copy or sealed copy), shared memory, mappings.

One module per concern, dependencies pointing one way (``a <- b``: b imports a)::

    _system <- counters <- shared_alloc <- proc_maps <- reopen <- placement (producer)
                           sealed_copy <- placement
    counters <- mappings (consumer)

* :mod:`~arrow_ipc_bridge.host.placement` -- where each exported buffer's bytes live: a zero-copy region on
  the file already mapped under it, or a copy, per the copy policy;
* :mod:`~arrow_ipc_bridge.host.proc_maps` -- which mapping holds an address (PROCMAP_QUERY or the text of
  /proc/self/maps), and whether its pages are the file's;
* :mod:`~arrow_ipc_bridge.host.reopen` -- a fresh read-only fd on the file behind a mapping;
* :mod:`~arrow_ipc_bridge.host.sealed_copy` -- the copies, in one memfd sealed before it leaves;
* :mod:`~arrow_ipc_bridge.host.shared_alloc` -- :func:`allocate_shared`, its registry and write seal;
* :mod:`~arrow_ipc_bridge.host.mappings` -- the consumer's read-only mappings and their cache;
* :mod:`~arrow_ipc_bridge.host.counters` -- the counters all of them keep (:func:`host_stats`).

:func:`reopen_read_only` (a sealed memfd's read-only descriptor, to send) serves the version board too.
Names with a leading underscore are private to the package even where a sibling module imports them.
"""

from arrow_ipc_bridge.host._system import reopen_read_only
from arrow_ipc_bridge.host.counters import HostStats, host_stats
from arrow_ipc_bridge.host.mappings import HostMappingCache, MappedRegion, map_host_region
from arrow_ipc_bridge.host.placement import (
    COPY_POLICIES,
    HostExport,
    HostRegion,
    Placement,
    export_host_buffers,
    find_shared_mapping,
)
from arrow_ipc_bridge.host.proc_maps import SharedMapping
from arrow_ipc_bridge.host.sealed_copy import BUFFER_ALIGNMENT, FULL_SEALS
from arrow_ipc_bridge.host.shared_alloc import F_SEAL_FUTURE_WRITE, SharedHostBuffer, allocate_shared

__all__ = [
    # producer
    "HostRegion",
    "Placement",
    "HostExport",
    "export_host_buffers",
    "COPY_POLICIES",
    "BUFFER_ALIGNMENT",
    "FULL_SEALS",
    # shared allocations
    "SharedHostBuffer",
    "allocate_shared",
    "F_SEAL_FUTURE_WRITE",
    "reopen_read_only",
    # diagnostics
    "SharedMapping",
    "find_shared_mapping",
    # consumer
    "MappedRegion",
    "map_host_region",
    "HostMappingCache",
    # counters
    "HostStats",
    "host_stats",
]
