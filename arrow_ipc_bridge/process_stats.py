"""Every process-wide counter of the bridge in one typed, frozen record: :func:`stats` (``aib.stats()``).

The counters live where they are kept -- :mod:`arrow_ipc_bridge.host.counters` (host placement and mappings),
:mod:`arrow_ipc_bridge.cuda._state`, :mod:`arrow_ipc_bridge.cuda.placer` and the C core (CUDA) -- except
the session's import paths, live streams and waits, which no single object owns and so are counted here.
:func:`stats` only reads them: it never loads the CUDA driver, so calling it in a process that never used
CUDA keeps CUDA untouched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

from arrow_ipc_bridge.host.counters import HostStats, host_stats

__all__ = [
    "BridgeStats",
    "HostStats",
    "CudaStats",
    "SessionStats",
    "StreamStats",
    "WaitStats",
    "stats",
    "import_counters",
    "stream_counters",
    "wait_counters",
    "in_place_publishes",
]


@dataclass(frozen=True)
class CudaStats:
    """This process's CUDA counters since import (producer and consumer sides both count)."""

    copied_bytes: int = 0  # device bytes copied into the bridge's IPC pool by copy policy
    copies: int = 0  # device-to-device copies made by copy policy
    legacy_opens: int = 0  # cuIpcOpenMemHandle calls (legacy CUDA IPC handles opened)
    legacy_hits: int = 0  # legacy handles found open already (no driver call)
    pool_imports: int = 0  # IPC memory pools imported (cuMemPoolImportFromShareableHandle)
    pool_pointer_imports: int = 0  # pointers imported from IPC pools
    pool_kept_hits: int = 0  # pool allocations found imported already (a kept slab)
    pool_fd_requests: int = 0  # pool fds asked of a producer (consumer side)
    pool_fds_served: int = 0  # pool fds sent to consumers that asked (producer side)
    same_process: int = 0  # regions and events resolved in the process that exported them
    # imports copied to another GPU (``to_device`` of imported data, ``cross_device="copy"``): the
    # copies made and the device bytes they copied
    device_copies: int = 0
    device_copied_bytes: int = 0
    c_imports: int = 0  # new messages the C core imported over handles already open here
    c_legacy_hits: int = 0  # open handles (legacy or kept pool slabs) those C imports used
    sync_events_pending: int = 0  # imported structs handed out with the producer's event still pending
    sync_events_complete: int = 0  # imported structs whose event had completed (sync_event NULL)
    export_region_entries: int = 0  # CUDA allocations the producer's export region table knows now
    export_region_hits: int = 0  # placements of CUDA buffers the export region table served (no driver query)
    export_region_misses: int = 0  # placements it sent to the full path (pointer queries, placement)
    # publishes of from_cuda_arrays columns naming the current version's memory (updated in place):
    # the publication's version renewed, its event re-recorded; no placement, encoding or new entry
    in_place_publishes: int = 0


@dataclass(frozen=True)
class SessionStats:
    """How this process's sessions imported what they received, by path, since import."""

    remembered_gets: int = 0  # gets of a remembered message, imported by the C core (the steady state)
    # of those, gets answered from the publisher's version board under a standing lease (no round trip)
    local_gets: int = 0
    # gets (and live-stream batches) of a message not remembered, imported by the C core all the same
    new_message_gets: int = 0
    python_imports: int = 0  # imports decoded and mapped (or opened) in Python: first sight of a message
    python_remembered_imports: int = 0  # imports in Python that reused a remembered decode and mapping
    # column_arrays(..., "cupy") calls answered with the CuPy arrays made for the same remembered
    # message before (standing leases; consumer/array_cache.py): no array made
    reused_cupy_arrays: int = 0


@dataclass(frozen=True)
class StreamStats:
    """Live streams (``docs/streams.md``) in this process since import: its publishers' side (sent,
    dropped, subscriptions) and its subscriptions' side (received)."""

    batches_sent: int = 0  # BATCH frames sent to subscribers (a batch counts once per subscriber)
    batches_dropped: int = 0  # batches dropped from slow consumers' queues (policy "drop_oldest")
    batches_received: int = 0  # batches this process's subscriptions received
    subscriptions: int = 0  # subscriptions this process's publishers accepted
    subscriptions_open: int = 0  # of those, served now (each holds one publisher thread)
    subscriptions_refused: int = 0  # SUBSCRIBEs refused at a publisher's max_subscriptions


@dataclass(frozen=True)
class WaitStats:
    """Waits for a name or a newer version (feature ``"watch"``) in this process since import."""

    waits_sent: int = 0  # WAITs this process's sessions sent (get(wait=...), get_next)
    # WAITs this process's publishers held (not answerable at once); one held again (its name was
    # unpublished under its answer) counts again
    waits_held: int = 0
    # sleeps of get_next on the publisher's version board (no WAIT sent; feature "board_wake"); a
    # wait longer than 50 ms counts once per 50 ms
    board_waits: int = 0
    # polls of get_next on the board with spin= (no sleep; one per 50 ms polled at most)
    board_spins: int = 0
    # connections this process's publishers closed because an answer to a held wait was due while
    # the client had not read what it was sent before (a client that stopped reading)
    stalled_waiters_closed: int = 0


@dataclass(frozen=True)
class BridgeStats:
    """A snapshot of every process-wide counter of the bridge, one section per part (see :func:`stats`)."""

    host: HostStats
    cuda: CudaStats
    session: SessionStats
    streams: StreamStats
    waits: WaitStats


class _ImportCounters(NamedTuple):
    """One counter per import path of :class:`SessionStats` (the same names, in the same order)."""

    remembered_gets: itertools.count[int]
    local_gets: itertools.count[int]
    new_message_gets: itertools.count[int]
    python_imports: itertools.count[int]
    python_remembered_imports: itertools.count[int]
    reused_cupy_arrays: itertools.count[int]


# The session counts with ``next(import_counters.PATH)``: one C call, atomic under the GIL and several times
# cheaper than taking a lock, which matters on the remembered-get path (the steady state, some tens of us per
# get). A fork child inherits the counts, as it inherits the host and CUDA ones.
import_counters = _ImportCounters(*(itertools.count() for _ in SessionStats.__dataclass_fields__))


class _StreamCounters(NamedTuple):
    """The counters behind :class:`StreamStats` (``subscriptions_open`` is started less ended)."""

    batches_sent: itertools.count[int]
    batches_dropped: itertools.count[int]
    batches_received: itertools.count[int]
    subscriptions_started: itertools.count[int]
    subscriptions_ended: itertools.count[int]
    subscriptions_refused: itertools.count[int]


stream_counters = _StreamCounters(*(itertools.count() for _ in _StreamCounters._fields))


class _WaitCounters(NamedTuple):
    """The counters behind :class:`WaitStats` (the same names, in the same order)."""

    waits_sent: itertools.count[int]
    waits_held: itertools.count[int]
    board_waits: itertools.count[int]
    board_spins: itertools.count[int]
    stalled_waiters_closed: itertools.count[int]


wait_counters = _WaitCounters(*(itertools.count() for _ in WaitStats.__dataclass_fields__))


# Publisher.publish counts its in-place renewals (CudaStats.in_place_publishes) here.
in_place_publishes = itertools.count()


def _read(counter: itertools.count[int]) -> int:
    # repr ("count(N)") is the one way to read an itertools.count without advancing it.
    return int(repr(counter)[len("count(") : -1])


def _cuda_section() -> CudaStats:
    # Imported here, not at module level: ``import arrow_ipc_bridge`` does not import the CUDA modules.
    # Importing them loads no driver, and cuda_stats() reads Python and C-core counters only.
    from arrow_ipc_bridge.cuda import placer
    from arrow_ipc_bridge.cuda._state import cuda_stats

    regions = placer.export_region_stats()  # the C core's table: no driver call
    return CudaStats(
        **cuda_stats(),
        export_region_entries=regions["entries"],
        export_region_hits=regions["hits"],
        export_region_misses=regions["misses"],
        in_place_publishes=_read(in_place_publishes),
    )


def _stream_section() -> StreamStats:
    counts = dict(zip(_StreamCounters._fields, map(_read, stream_counters), strict=True))
    return StreamStats(
        batches_sent=counts["batches_sent"],
        batches_dropped=counts["batches_dropped"],
        batches_received=counts["batches_received"],
        subscriptions=counts["subscriptions_started"],
        subscriptions_open=counts["subscriptions_started"] - counts["subscriptions_ended"],
        subscriptions_refused=counts["subscriptions_refused"],
    )


def stats() -> BridgeStats:
    """Every process-wide counter of the bridge since import, as one frozen record.

    ``host``: host-memory placement (bytes copied, zero-copy regions, /proc lookups, shared allocations)
    and mappings of received regions; ``cuda``: device copies by policy, IPC handle opens and cache hits,
    pool imports, sync events, the producer's export region table; ``session``: imports by path (C core
    with a remembered message, C core with a new one, Python); ``streams``: live-stream batches sent,
    dropped and received, subscriptions; ``waits``: waits for names and versions sent and held.
    docs/api.md lists every field. Reading the counters never loads the CUDA driver.
    """
    session = SessionStats(*(_read(counter) for counter in import_counters))
    waits = WaitStats(*(_read(counter) for counter in wait_counters))
    return BridgeStats(
        host=host_stats(), cuda=_cuda_section(), session=session, streams=_stream_section(), waits=waits
    )
