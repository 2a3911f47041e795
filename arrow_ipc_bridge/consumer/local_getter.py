"""The C core's local getter over a session's state (``cffi_build/py_local_get.c``).

A re-get the publisher's version board answers (the name's remembered message holds a standing
lease and the board shows the same publication) is made in one builtin call, the imported object
included. It exists because the same steps in Python cost several times as much on a GPU machine's
consumer, most of all after it slept between steps (cold caches; ``docs/lifetime.md``, 5b, and
``docs/benchmarks.md``). Anything else answers None and the session takes ``Session._get_now``.
"""

from __future__ import annotations

from typing import Any

from arrow_ipc_bridge._ffi import LocalGetter, ffi, lib
from arrow_ipc_bridge.consumer.array_cache import KeptCupyArrays
from arrow_ipc_bridge.consumer.message_import import ImportedRefs
from arrow_ipc_bridge.consumer.remembered import RememberedMessages
from arrow_ipc_bridge.process_stats import import_counters
from arrow_ipc_bridge.transport.board import SessionBoard
from arrow_ipc_bridge.transport.channel import Channel
from arrow_ipc_bridge.wire.metadata import Decoded

__all__ = ["new_local_getter"]

# What the getter makes cffi pointers with: ffi.cast, ffi.gc, the owner's unref, the owner's and the
# sync slot's pointer types, and NULL.
_KIT = (
    ffi.cast,
    ffi.gc,
    lib.aib_owner_unref,
    ffi.typeof("aib_owner *"),
    ffi.typeof("uint64_t *"),
    ffi.NULL,
)


def new_local_getter(
    channel: Channel,
    board: SessionBoard,
    remembered: RememberedMessages,
    *,
    request_lock: Any,
    kept_arrays: KeptCupyArrays | None,
    imported: ImportedRefs,
) -> Any:
    """A session's getter: its ``get(name)`` returns the imported object of a local answer, or None
    (nothing sent or changed); ``close()`` makes it answer None from then on; ``gets`` counts its
    answers. ``request_lock`` is the session's; the channel's receive lock is taken too, in that
    order, as ``Session._get_now`` takes them. ``imported``: the session's set of live imports."""
    return LocalGetter(
        int(ffi.cast("uintptr_t", channel.raw)),
        int(ffi.cast("uintptr_t", remembered.table)),
        int(ffi.cast("uintptr_t", board.address)),
        board.n_slots,
        (channel, remembered.table, board),  # what keeps the three pointers valid
        channel,
        request_lock,
        channel.locked()[0],  # the receive lock
        remembered._by_id,
        Decoded,
        _KIT,
        (import_counters.remembered_gets, import_counters.local_gets),
        kept_arrays,
        imported,
    )
