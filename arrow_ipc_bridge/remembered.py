"""The consumer's remembered messages: imported messages a session keeps with their regions open.

A re-get of the same publication (the steady state) finds its message remembered and is imported
from it without a decode or an open: by the C core (``aib_import_cache``, this class's mirror in C,
which :meth:`Session.get <arrow_ipc_bridge.session.Session.get>` passes to the channel) or, for
:meth:`Session.import_message <arrow_ipc_bridge.session.Session.import_message>`, by Python.
:class:`RememberedMessages` owns the set: what is remembered (a *remembered message*: its validated
decode, the *template*, holding every region's owner open), lookup, the least-recently-used bound
(``remembered_messages``), forgetting (a name got with other data, :meth:`Session.forget`, close) and
the *kept lease* of a remembered IPC-pool message, given back ``pool_linger`` seconds after its last
get (the ``_linger`` thread asks :meth:`RememberedMessages._expire_kept_leases`). ``docs/lifetime.md``
("Remembered messages") describes the rules; the session decides what to import and calls in here.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arrow_ipc_bridge import _linger
from arrow_ipc_bridge._ffi import ffi, lib
from arrow_ipc_bridge.capsules import DEVICE_CUDA
from arrow_ipc_bridge.imported import ImportedArray, ImportedStream
from arrow_ipc_bridge.metadata import REGION_CUDA_LEGACY, REGION_CUDA_POOL, REGION_FLAG_KEPT, Decoded, Region

__all__ = ["RememberedMessage", "RememberedMessages", "needs_lease"]

# How many names' last unremembered message is compared with their next get (got_again).
_GOT_ONCE_NAMES_MAX = 256


@dataclass(frozen=True)
class RememberedMessage:
    """A message already imported in this session, its regions still open: re-gets of the same
    publication (the steady state) skip the decode and the opens."""

    template: Decoded  # the validated message; its owner holds every region's owner open
    bases: Any  # uint64_t[] of region bases, shared read-only by every import of the message
    device_type: int
    device_id: int
    event: int  # the opened producer event, 0 when none
    entry_id: int  # its name in the C core's mirror of the set (aib_import_cache)
    imported_type: type[ImportedArray] | type[ImportedStream]
    # (st_dev, st_ino) of each descriptor it came with, in order; None: its descriptors name nothing
    # the message does not (CUDA pool fds), any will do
    files: tuple[tuple[int, int], ...] | None


class RememberedMessages:
    """A session's remembered messages, at most ``limit`` (least recently used out first), one per name.

    Lock order: the session's ``request_lock``, then this set's own lock. Changes to the set take
    both, so a get holding ``request_lock`` finds the entry its C lookup found (``Session.get``).
    """

    def __init__(self, limit: int, pool_linger: float, request_lock: threading.Lock) -> None:
        self.limit = limit  # 0 remembers nothing
        self._pool_linger = pool_linger
        self._request_lock = request_lock
        self._lock = threading.Lock()
        # message bytes -> remembered message; bounded, entries hold their regions open
        self._by_message: OrderedDict[bytes, RememberedMessage] = OrderedDict()
        self._by_entry_id: dict[int, RememberedMessage] = {}
        self._entry_ids = itertools.count(1)
        self._message_by_name: dict[str, bytes] = {}  # the message each name was last remembered with
        # Remembered pool messages holding a kept lease -> when a get last used them (time.monotonic()).
        self._kept_lease_used: dict[bytes, float] = {}
        # name -> hash of the message its last get imported without remembering it: a pool message
        # (kept with a lease) and a new message the C core imported are remembered from their second
        # get in a row on, so a stream of new data pins nothing and costs no template.
        self._got_once: OrderedDict[str, int] = OrderedDict()
        self._closed = False
        cache = lib.aib_import_cache_new()
        if cache == ffi.NULL:
            raise MemoryError("allocating the import cache")
        self.import_cache = ffi.gc(cache, lib.aib_import_cache_free)
        """The C core's mirror of the set (``aib_import_cache``), which C-side gets look up."""

    def __len__(self) -> int:
        return len(self._by_message)

    # ---------- lookup ------------------------------------------------------------------------------
    def lookup(
        self, message: bytes, files: tuple[tuple[int, int], ...] | None, token: int
    ) -> tuple[RememberedMessage, Decoded] | None:
        """The remembered message these bytes with these descriptors' ``files`` are, and an import
        sharing its template (owner token ``token``); None when not remembered."""
        with self._lock:
            hit = self._by_message.get(message)
            # The same bytes describe other data when they arrive with other files (a host region's
            # message names no file): only the files the template mapped make it the same message.
            if hit is not None and (hit.files is None or (files is not None and hit.files == files)):
                # Share under the lock: another thread may evict the entry next.
                self._by_message.move_to_end(message)
                decoded = Decoded.sharing(hit.template, token)
                if message in self._kept_lease_used:
                    self._kept_lease_used[message] = time.monotonic()
                return hit, decoded
        return None

    def used_by_c_core(self, entry_id: int) -> RememberedMessage | None:
        """The remembered message a C-side get just imported (the caller holds ``request_lock``, so
        it is here), marked as used; None if it vanished (cannot happen)."""
        hit = self._by_entry_id.get(entry_id)
        if hit is None:
            return None
        key = hit.template.message
        with self._lock:
            self._by_message.move_to_end(key)
            if key in self._kept_lease_used:
                self._kept_lease_used[key] = time.monotonic()
        return hit

    # ---------- remembering -------------------------------------------------------------------------
    def keeps_pool_lease(self, regions: list[Region], message: bytes, name: str | None, token: int) -> bool:
        """Whether this get's message is remembered with its lease: IPC-pool data (CUDA regions that
        can all stay open, one at least in a pool) got under the same name with the same bytes
        twice in a row. A stream of new data (every get a new message) is never kept."""
        if token == 0 or name is None or self._pool_linger <= 0 or not regions or not self.limit:
            return False
        kinds = {r.kind for r in regions}
        if not needs_lease(regions) or not kinds <= {REGION_CUDA_POOL, REGION_CUDA_LEGACY}:
            return False
        return self.got_again(name, message)

    def got_again(self, name: str, message: bytes) -> bool:
        """Whether the last get of ``name`` that remembered nothing returned these same bytes (and
        records them for the next get when not)."""
        digest = hash(message)
        with self._lock:
            if self._got_once.pop(name, None) == digest:
                return True
            self._got_once[name] = digest
            if len(self._got_once) > _GOT_ONCE_NAMES_MAX:
                self._got_once.popitem(last=False)
        return False

    def remember(
        self,
        template: Decoded,
        bases: Any,
        device_type: int,
        device_id: int,
        event: int,
        *,
        files: tuple[tuple[int, int], ...] | None,
        name: str | None,
        lingers: bool = False,
    ) -> None:
        """Remember ``template`` (it holds the message's regions open; ours from here on) for re-gets
        of the same message with the same files. A name keeps one remembered message: the one it
        was last got with (a name republished with other data does not pin the old regions until
        eviction). ``lingers``: the template holds a kept lease, given back ``pool_linger`` seconds
        after the last get that used it (or on eviction)."""
        if not self.limit:  # remembers nothing
            template.close()
            return
        key = template.message
        imported_type = ImportedStream if template.is_stream else ImportedArray
        # Leases of the message share the template's decode and this view: the C core builds their
        # capsules from their owner alone (capsules.device_array_capsules). Without it (out of
        # memory) they take the Python path.
        lib.aib_owner_set_view(template.owner, bases, len(bases), device_type, device_id)
        remembered = RememberedMessage(
            template, bases, device_type, device_id, event, next(self._entry_ids), imported_type, files
        )
        identities = ffi.new("aib_file_identity[]", max(len(files or ()), 1))
        for i, (dev, ino) in enumerate(files or ()):
            identities[i].dev = dev
            identities[i].ino = ino
        cache = self.import_cache
        with self._request_lock, self._lock:
            if self._closed:
                template.close()
                return
            if lib.aib_import_cache_put(
                cache,
                key,
                len(key),
                template.owner,
                event,
                remembered.entry_id,
                identities,
                len(files or ()),
                lib.AIB_CACHE_FDS_SAME_FILES if files is not None else lib.AIB_CACHE_FDS_ANY,
            ):
                template.close()  # not remembered (out of memory): the import itself is fine
                return
            evicted: list[RememberedMessage | None] = []
            previous = self._by_message.pop(key, None)  # two threads remembered the same message
            if previous is not None:  # the put above replaced it in the C mirror already
                self._by_entry_id.pop(previous.entry_id, None)
                evicted.append(previous)
            if name is not None:
                replaced_key = self._message_by_name.get(name)
                self._message_by_name[name] = key
                if replaced_key is not None and replaced_key != key:
                    evicted.append(self._forget_locked(replaced_key))
            self._by_message[key] = remembered
            self._by_entry_id[remembered.entry_id] = remembered
            if lingers:
                self._kept_lease_used[key] = time.monotonic()
            else:
                self._kept_lease_used.pop(key, None)
            while len(self._by_message) > self.limit:
                evicted.append(self._forget_locked(next(iter(self._by_message))))
            _close_templates(evicted)
        if lingers:
            _linger.watch(self)

    def remember_new(
        self, owner: Any, message: bytes, bases: Any, device_id: int, *, name: str, lease_keeper: Any
    ) -> None:
        """Remember a message the C core imported: a template with a decode of its own that holds
        what the import's owner holds open (the region table's owners), not its lease."""
        template = Decoded(message, 0)
        try:
            if lib.aib_owner_copy_dependencies(template.owner, owner, lease_keeper):
                raise MemoryError("copying owner dependencies")
        except BaseException:
            template.close()
            raise
        event = int(lib.aib_owner_slot(owner)[0])
        self.remember(template, bases, DEVICE_CUDA, device_id, event, files=None, name=name)

    # ---------- forgetting --------------------------------------------------------------------------
    def forget_replaced(self, name: str, message: bytes) -> None:
        """``name`` now holds ``message``, which is not remembered: the message remembered under the
        name before is stale (its regions, and a kept lease, would otherwise wait for eviction)."""
        with self._request_lock, self._lock:
            key = self._message_by_name.get(name)
            if key is None or key == message:
                return
            del self._message_by_name[name]
            stale = self._forget_locked(key)
        _close_templates([stale])

    def forget(self, name: str | None) -> int:
        """Forget the message last remembered as ``name``, or all of them (None); returns how many."""
        with self._request_lock, self._lock:
            if name is None:
                keys = list(self._by_message)
                self._message_by_name.clear()
            else:
                key = self._message_by_name.pop(name, None)
                keys = [] if key is None else [key]
            forgotten = [self._forget_locked(key) for key in keys]
            _close_templates(forgotten)
        return sum(remembered is not None for remembered in forgotten)

    def close(self) -> None:
        """Forget every remembered message; nothing is remembered after (the session closed)."""
        with self._request_lock, self._lock:
            self._closed = True
            forgotten = [self._forget_locked(key) for key in list(self._by_message)]
            self._message_by_name.clear()
        _close_templates(forgotten)

    def _forget_locked(self, key: bytes) -> RememberedMessage | None:
        """Drop remembered message ``key`` (both locks held); the caller closes its template."""
        remembered = self._by_message.pop(key, None)
        if remembered is None:
            return None
        lib.aib_import_cache_remove(self.import_cache, key, len(key))
        self._by_entry_id.pop(remembered.entry_id, None)
        self._kept_lease_used.pop(key, None)
        return remembered

    def _expire_kept_leases(self, now: float) -> float | None:
        """Give back the kept leases of remembered pool messages no get used for ``pool_linger``
        seconds (called by the _linger thread); returns the next deadline, None when none is kept."""
        if self._closed:
            return None
        if not self._request_lock.acquire(blocking=False):  # a get in flight: ask again soon
            return now + _linger.BUSY_RETRY_S
        try:
            with self._lock:
                expired = [
                    key for key, used in self._kept_lease_used.items() if now - used >= self._pool_linger
                ]
                forgotten = [self._forget_locked(key) for key in expired]
                next_deadline = min(self._kept_lease_used.values(), default=None)
            _close_templates(forgotten)
        finally:
            self._request_lock.release()
        return None if next_deadline is None else next_deadline + self._pool_linger


def _close_templates(forgotten: Sequence[RememberedMessage | None]) -> None:
    """Close the templates of remembered messages just forgotten (None: nothing was there)."""
    for remembered in forgotten:
        if remembered is not None:
            remembered.template.close()


def needs_lease(regions: list[Region]) -> bool:
    """Whether keeping these regions imported needs a lease: a pool allocation the producer may
    free (one not flagged kept), which CUDA wants freed here first."""
    return any(r.kind == REGION_CUDA_POOL and not r.flags & REGION_FLAG_KEPT for r in regions)
