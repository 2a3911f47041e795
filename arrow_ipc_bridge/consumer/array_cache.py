"""CuPy arrays a session keeps per name and hands out again (``column_arrays``).

Making CuPy arrays over imported columns costs what CuPy's own wrapping costs: an ``UnownedMemory``,
a ``MemoryPointer`` and an ``ndarray`` per column, on every call (``docs/benchmarks.md`` has the
figures). A consumer that re-gets a name every step under a standing lease imports the same
remembered message each time, at the same addresses; the arrays it made last step are the arrays it
needs now. So a session that keeps standing leases (every session but one with ``pool_linger=0``)
keeps, per (name, batch, columns), the last CuPy arrays ``column_arrays`` made, and hands the same
objects out again when nobody else holds them any more.

The rules (``docs/lifetime.md``, "Kept CuPy arrays"):

- The arrays are handed out again only for an import of the same remembered message they were made
  for (the same :class:`~arrow_ipc_bridge.consumer.remembered.RememberedMessage`, so the same addresses,
  lengths and types), and only while this cache is the only holder of every array, of its
  ``MemoryPointer`` and of its ``UnownedMemory`` (their reference counts are back to what the cache
  itself holds), and every array still has the shape it was made with (CuPy lets ``shape`` be set
  in place). Otherwise new arrays are made, and kept instead.
- The arrays' owner (every ``UnownedMemory``'s) is a :class:`_LeaseHolder`. Handing them out again
  moves the holder to the new get's batch lease and lets go of the old one, so the arrays hold the
  latest get, as new arrays would.
- A kept entry holds its batch lease (and so the name's standing lease) until it is dropped:
  ``pool_linger`` seconds after its last hand-out (the ``_linger`` thread), on
  :meth:`Session.forget <arrow_ipc_bridge.consumer.session.Session.forget>` and on ``Session.close``, which
  is what a standing lease already promises. Arrays the user still holds keep their lease then, as
  any array does.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from arrow_ipc_bridge.consumer import linger
from arrow_ipc_bridge.process_stats import import_counters

__all__ = ["KeptCupyArrays", "CacheKey"]

# (name, batch, the columns asked for or None: every numeric one)
CacheKey = tuple[str, int, tuple[str, ...] | None]
# (name, numeric type index, length, null count, address): a column fact of columns.column_arrays
_Fact = tuple[str, int, int, int, Any]
# Makes (arrays, pointers, memories) over the facts, owned by the holder, on the device.
Builder = Callable[[Sequence[_Fact], object, int], tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]]

_refcount = sys.getrefcount


class _LeaseHolder:
    """The owner of kept arrays' memory: holds one batch lease, which a hand-out replaces."""

    __slots__ = ("lease",)

    def __init__(self, lease: object) -> None:
        self.lease = lease


@dataclass
class _Kept:
    message: object  # the remembered message the arrays were made for (compared by identity)
    facts: tuple[_Fact, ...]
    device: int
    holder: _LeaseHolder
    names: tuple[str, ...]
    arrays: tuple[Any, ...]
    pointers: tuple[Any, ...]  # each array's MemoryPointer
    memories: tuple[Any, ...]  # each pointer's UnownedMemory
    shapes: list[tuple[int, ...]]
    baseline: int = 0  # the reference counts of all three when only this entry holds them
    last_used: float = 0.0

    def held_elsewhere(self) -> bool:
        """Whether anything but this entry holds an array, a pointer or a memory, or an array's
        shape was changed: then the arrays may not be handed out again."""
        return self.references() != self.baseline or [array.shape for array in self.arrays] != self.shapes

    def references(self) -> int:
        """The reference counts of every array, pointer and memory, summed (none can fall below
        what the entry and the objects' own links hold, so an equal sum means equal counts)."""
        count = _refcount
        return sum(map(count, self.arrays)) + sum(map(count, self.pointers)) + sum(map(count, self.memories))


class KeptCupyArrays:
    """One session's kept CuPy arrays, one entry per (name, batch, columns); see the module docstring.

    Thread-safe: a hand-out checks and takes an entry under the lock, so two threads never get the
    same arrays from one check. Entries are let go outside the lock (their lease's end may call into
    the reaper)."""

    def __init__(self, linger: float) -> None:
        self._linger = linger
        self._lock = threading.Lock()
        self._kept: dict[CacheKey, _Kept] = {}
        self._closed = False
        self.handed_out_again = 0
        """Batches whose kept arrays were handed out again (no array made)."""

    def __len__(self) -> int:
        return len(self._kept)

    def facts_of(self, key: CacheKey, message: object) -> tuple[_Fact, ...] | None:
        """The column facts of the entry kept for ``key`` when it was made for ``message`` (the
        caller then needs only the batch's lease and event), else None."""
        kept = self._kept.get(key)
        if kept is None or kept.message is not message:
            return None
        return kept.facts

    def hand_out(
        self,
        key: CacheKey,
        message: object,
        facts: Sequence[_Fact],
        lease: object,
        *,
        device: int,
        build: Builder,
    ) -> dict[str, Any]:
        """``{name: array}`` over ``facts`` holding ``lease``: the kept arrays for ``key`` when they
        may be handed out again, else new ones from ``build``, kept from now on."""
        facts = tuple(facts)
        old_lease: object = None
        dropped: _Kept | None = None
        made = False
        with self._lock:
            kept = self._kept.get(key)
            if (
                kept is not None
                and kept.message is message
                and kept.device == device
                and kept.facts == facts
                and not kept.held_elsewhere()
            ):
                old_lease, kept.holder.lease = kept.holder.lease, lease
                kept.last_used = time.monotonic()  # the linger thread finds the later deadline itself
                self.handed_out_again += 1
                next(import_counters.reused_cupy_arrays)
                result = dict(zip(kept.names, kept.arrays, strict=True))
            else:
                made = not self._closed
                result, dropped = self._make_locked(key, message, facts, lease, device=device, build=build)
            del kept
        del old_lease, dropped  # outside the lock: a lease's end may give it back through the reaper
        if made:
            linger.watch(self)
        return result

    def _make_locked(
        self,
        key: CacheKey,
        message: object,
        facts: tuple[_Fact, ...],
        lease: object,
        *,
        device: int,
        build: Builder,
    ) -> tuple[dict[str, Any], _Kept | None]:
        """New arrays, kept for ``key`` unless the cache is closed; (result, the entry they replace)."""
        holder = _LeaseHolder(lease)
        arrays, pointers, memories = build(facts, holder, device)
        names = tuple(fact[0] for fact in facts)
        if self._closed:
            return dict(zip(names, arrays, strict=True)), None
        kept = _Kept(
            message,
            facts,
            device,
            holder,
            names,
            arrays,
            pointers,
            memories,
            [array.shape for array in arrays],
            last_used=time.monotonic(),
        )
        # Counted while only the entry holds them (the three tuples are the entry's own).
        del arrays, pointers, memories
        kept.baseline = kept.references()
        dropped = self._kept.pop(key, None)
        self._kept[key] = kept
        return dict(zip(kept.names, kept.arrays, strict=True)), dropped

    def forget(self, name: str | None) -> None:
        """Let go of the entries of ``name``, or of all (None)."""
        with self._lock:
            keys = [key for key in self._kept if name is None or key[0] == name]
            dropped = [self._kept.pop(key) for key in keys]
        del dropped

    def close(self) -> None:
        """Let go of every entry; nothing is kept after (the session closed)."""
        with self._lock:
            self._closed = True
            dropped = list(self._kept.values())
            self._kept.clear()
        del dropped

    def _expire_kept_leases(self, now: float) -> float | None:
        """Let go of the entries not handed out for the linger time (the ``_linger`` thread calls
        this with ``time.monotonic()``); returns the next deadline, None when nothing is kept."""
        with self._lock:
            expired = [key for key, kept in self._kept.items() if kept.last_used + self._linger <= now]
            dropped = [self._kept.pop(key) for key in expired]
            deadline = min((kept.last_used + self._linger for kept in self._kept.values()), default=None)
        del dropped
        return deadline
