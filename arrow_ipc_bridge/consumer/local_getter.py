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

__all__ = ["new_local_getter"]


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
    order, as ``Session._get_now`` takes them. ``imported``: the session's set of live imports.

    The getter reads no Python attribute: the remembered messages (``RememberedMessage``) and the
    objects it makes keep their state in the slots of the C core's base types
    (``cffi_build/py_state.c``), the channel's closed state is the C channel's, and each callable
    it uses is handed over here."""
    recv_lock = channel.locked()[0]
    return LocalGetter(
        channel=int(ffi.cast("uintptr_t", channel.raw)),
        remembered=int(ffi.cast("uintptr_t", remembered.table)),
        board=int(ffi.cast("uintptr_t", board.address)),
        board_slots=board.n_slots,
        keep_alive=(channel, remembered.table, board),  # what keeps the three pointers valid
        request_acquire=request_lock.acquire,
        request_release=request_lock.release,
        recv_acquire=recv_lock.acquire,
        recv_release=recv_lock.release,
        by_id=remembered._by_id,  # entry id -> RememberedMessage
        # What the getter makes cffi pointers with: the owner as Decoded holds it
        # (ffi.gc(ffi.cast("aib_owner *", address), lib.aib_owner_unref)) and the event slot.
        cast=ffi.cast,
        gc=ffi.gc,
        unref=lib.aib_owner_unref,
        owner_ctype=ffi.typeof("aib_owner *"),
        slot_ctype=ffi.typeof("uint64_t *"),
        null=ffi.NULL,
        remembered_gets=import_counters.remembered_gets,
        local_gets=import_counters.local_gets,
        kept_arrays=kept_arrays,
        tracked=imported,
        untrack=imported.discard,
    )
