"""The consumer's remembered messages: imported messages a session keeps with their regions open.

A re-get of the same publication (the steady state) finds its message remembered and is imported
from it without a decode or an open: by the C core, in the get itself (``aib_session_get``), or, for
:meth:`Session.import_message <arrow_ipc_bridge.consumer.session.Session.import_message>`, by Python.
The set itself lives in the C core (``aib_remembered``, ``cffi_build/remembered.c``): which
messages are remembered (a *remembered message*: its validated decode, the *template*, holding every
region's owner open), lookup by bytes and files, one message per name, the least-recently-used bound
(``remembered_messages``) and when each *kept lease* of a remembered IPC-pool message was last used
(given back ``pool_linger`` seconds later: the ``_linger`` thread asks
:meth:`RememberedMessages._expire_kept_leases`). :class:`RememberedMessages` asks it and keeps only
what C cannot hold: each message's Python objects, by the id the set gave it. ``docs/lifetime.md``
("Remembered messages") describes the rules; the session decides what to import and calls in here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from arrow_ipc_bridge._ffi import RememberedState, ffi, lib
from arrow_ipc_bridge.consumer import linger
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream, imported_class
from arrow_ipc_bridge.cuda.cross_gpu import reader_view
from arrow_ipc_bridge.errors import BridgeError
from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA
from arrow_ipc_bridge.wire.metadata import (
    REGION_CUDA_LEGACY,
    REGION_CUDA_POOL,
    REGION_FLAG_KEPT,
    Decoded,
    Region,
)

__all__ = ["RememberedMessage", "RememberedMessages", "needs_lease"]

# How many names' last unremembered message is compared with their next get (got_again).
_GOT_ONCE_NAMES_MAX = 256
# A limit above this (a size_t in C) remembers as much as one without a bound.
_LIMIT_MAX = 2**62


class RememberedMessage(RememberedState):
    """The Python side of a remembered message (the C set holds the rest): what an import of it
    is built from, set once. ``RememberedMessage(template, bases, device_type, device_id,
    imported_type, mapped_on)``; a ``TypeError`` when ``template`` is not a
    :class:`~arrow_ipc_bridge.wire.metadata.Decoded` or ``imported_type`` not an imported class.

    Its attributes are the read-only slots of the C base type (``RememberedState``,
    ``cffi_build/py_state.c``), which the C core's local getter reads by offset
    (``Session._adopt_remembered`` reads them here)."""

    template: Decoded  # the validated message; its owner holds every region's owner open
    bases: Any  # uint64_t[] of region bases, shared read-only by every import of the message
    n_bases: int  # len(bases)
    device_type: int
    device_id: int
    imported_type: type[ImportedArray] | type[ImportedStream]
    # (reader GPU, indexes of the regions opened again there) when ``bases`` are where a session's
    # reader GPU reads the message in place (``cross_gpu.reader_view``); its imports carry it as
    # ``_mapped_on``, so the session's placement hands them out as they are. None otherwise.
    mapped_on: tuple[int, frozenset[int]] | None

    def __repr__(self) -> str:
        return (
            f"<RememberedMessage {self.imported_type.__name__} device_type={self.device_type} "
            f"device_id={self.device_id} mapped_on={self.mapped_on}>"
        )


class RememberedMessages:
    """A session's remembered messages, at most ``limit`` (least recently used out first), one per name.

    Lock order: the session's ``request_lock``, then this object's own lock. Changes to the set take
    both, so a get holding ``request_lock`` finds the Python side of the message its C lookup found
    (``Session.get``); a lookup from Python takes this object's lock.
    """

    def __init__(
        self, limit: int, pool_linger: float, request_lock: threading.Lock, *, reader: int | None = None
    ) -> None:
        self._pool_linger = pool_linger
        # The session's reader GPU when it reads other GPUs' data in place (cross_device="peer"):
        # messages on another GPU are remembered as the reader reads them.
        self._reader = reader
        self._request_lock = request_lock
        self._lock = threading.Lock()
        # The Python side of each message the C set holds, by its id there.
        self._by_id: dict[int, RememberedMessage] = {}
        # name -> hash of the message its last get imported without remembering it: a pool message
        # (kept with a lease) and a new message the C core imported are remembered from their second
        # get in a row on, so a stream of new data pins nothing and costs no template. Not a fact
        # about remembered messages, so it lives here.
        self._got_once: OrderedDict[str, int] = OrderedDict()
        self._closed = False
        table = lib.aib_remembered_new(min(limit, _LIMIT_MAX))
        if table == ffi.NULL:
            raise MemoryError("allocating the remembered messages")
        self.table = ffi.gc(table, lib.aib_remembered_free)
        """The set itself (``aib_remembered``), which C-side gets look up and update."""

    def __len__(self) -> int:
        return int(lib.aib_remembered_count(self.table))

    @property
    def limit(self) -> int:
        """How many messages are remembered at most (0: none); lowering it forgets the least
        recently used at once."""
        return int(lib.aib_remembered_limit(self.table))

    @limit.setter
    def limit(self, limit: int) -> None:
        with self._request_lock, self._lock:
            lib.aib_remembered_set_limit(self.table, min(limit, _LIMIT_MAX))
            _close_templates(self._take_forgotten_locked())

    # ---------- lookup ------------------------------------------------------------------------------
    def lookup(
        self, message: bytes, fds: Sequence[int], token: int
    ) -> tuple[RememberedMessage, Any, int] | None:
        """The remembered message these bytes arriving with ``fds`` are, an owner for an import of
        it (token ``token``, sharing its template: ``RememberedMessage.adopt`` builds the import)
        and its event (0: none); None when not remembered.

        The same bytes describe other data when they arrive with other files (a host region's
        message names no file): the set matches the files the template mapped, as in C gets."""
        fd_array = ffi.new("int[]", list(fds)) if fds else ffi.NULL
        event = ffi.new("uint64_t *")
        with self._lock:
            found = lib.aib_remembered_find(self.table, message, len(message), fd_array, len(fds), event)
            if not found:
                return None
            hit = self._by_id[found]
            # Share under the lock: another thread may forget the message next.
            return hit, hit.template.sharing_owner(token), int(event[0])

    def board_place(self, raw_name: bytes) -> tuple[int, int] | None:
        """``(board slot, entry serial)`` of the message remembered as ``raw_name`` while it holds a
        standing lease (the session's gets of the name are local then); None otherwise."""
        slot = ffi.new("uint32_t *")
        serial = ffi.new("uint64_t *")
        if not lib.aib_remembered_board_place(self.table, raw_name, len(raw_name), slot, serial):
            return None
        return int(slot[0]), int(serial[0])

    def used_by_c_core(self, entry_id: int) -> RememberedMessage | None:
        """The remembered message a C-side get just imported (and marked used); the caller holds
        ``request_lock``, so it is here. None if it vanished (cannot happen)."""
        return self._by_id.get(entry_id)

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
        of the same message with the same ``files`` (None: any descriptors). A name keeps one
        remembered message: the one it was last got with (a name republished with other data does
        not pin the old regions until eviction). ``lingers``: the template holds a kept lease, given
        back ``pool_linger`` seconds after the last get that used it (or when forgotten)."""
        if not self.limit:  # remembers nothing
            template.close()
            return
        key = template.message
        imported_type = imported_class(template.is_stream, device_type)
        bases, mapped_on = self._as_reader_reads(template, bases, device_type, device_id)
        # Leases of the message share the template's decode and this view: the C core builds their
        # capsules from their owner alone (capsules.device_array_capsules). Without it (out of
        # memory) they take the Python path.
        lib.aib_owner_set_view(template.owner, bases, len(bases), device_type, device_id)
        remembered = RememberedMessage(template, bases, device_type, device_id, imported_type, mapped_on)
        identities = ffi.new("aib_file_identity[]", max(len(files or ()), 1))
        for i, (dev, ino) in enumerate(files or ()):
            identities[i].dev = dev
            identities[i].ino = ino
        raw_name = ffi.NULL if name is None else _name_bytes(name)
        entry_id = ffi.new("uint64_t *")
        with self._request_lock, self._lock:
            if self._closed:
                template.close()
                return
            if (
                lib.aib_remembered_put(
                    self.table,
                    key,
                    len(key),
                    template.owner,
                    event,
                    identities,
                    len(files or ()),
                    lib.AIB_REMEMBERED_SAME_FILES if files is not None else lib.AIB_REMEMBERED_ANY_FDS,
                    raw_name,
                    0 if name is None else len(raw_name),
                    lingers,
                    entry_id,
                )
                or not entry_id[0]
            ):
                template.close()  # not remembered (out of memory, or the limit is 0): the import is fine
                return
            self._by_id[entry_id[0]] = remembered
            _close_templates(self._take_forgotten_locked())
        if lingers:
            linger.watch(self)

    def _as_reader_reads(
        self, template: Decoded, bases: Any, device_type: int, device_id: int
    ) -> tuple[Any, tuple[int, frozenset[int]] | None]:
        """``(bases, mapped_on)`` a message on GPU ``device_id`` is remembered with: where this
        session's reader GPU reads it in place, when it has one (the template then holds the
        reader's mappings), so every re-get hands out a readable object with no placement work;
        ``(bases, None)`` otherwise. A grant the driver refuses leaves the message as it is: the
        get's placement raises the documented error."""
        reader = self._reader
        if reader is None or device_type != DEVICE_CUDA or device_id == reader:
            return bases, None
        try:
            view = reader_view(template, bases, device_id, reader)
        except BridgeError:
            return bases, None
        if view is None:  # granted per get (a VMM region): placed per get
            return bases, None
        group, reader_bases, remapped = view
        if group is not None:
            template.depend_on(group)
        return reader_bases, (reader, remapped)

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
        raw_name = _name_bytes(name)
        with self._request_lock, self._lock:
            if lib.aib_remembered_forget_name(self.table, raw_name, len(raw_name), message, len(message)):
                _close_templates(self._take_forgotten_locked())

    def forget(self, name: str | None) -> int:
        """Forget the message last remembered as ``name``, or all of them (None); returns how many."""
        with self._request_lock, self._lock:
            if name is None:
                forgotten = lib.aib_remembered_forget_all(self.table)
            else:
                raw_name = _name_bytes(name)
                forgotten = lib.aib_remembered_forget_name(self.table, raw_name, len(raw_name), ffi.NULL, 0)
            _close_templates(self._take_forgotten_locked())
        return int(forgotten)

    def close(self) -> None:
        """Forget every remembered message; nothing is remembered after (the session closed)."""
        with self._request_lock, self._lock:
            self._closed = True
            lib.aib_remembered_forget_all(self.table)
            forgotten = self._take_forgotten_locked()
        _close_templates(forgotten)

    def _take_forgotten_locked(self) -> list[RememberedMessage | None]:
        """The Python side of every message the set let go of (both locks held); the caller closes
        their templates."""
        forgotten: list[RememberedMessage | None] = []
        while entry_id := lib.aib_remembered_take_forgotten(self.table):
            forgotten.append(self._by_id.pop(entry_id, None))
        return forgotten

    def _expire_kept_leases(self, now: float) -> float | None:
        """Give back the kept leases of remembered pool messages no get used for ``pool_linger``
        seconds (called by the _linger thread with ``time.monotonic()``, the set's clock); returns
        the next deadline, None when none is kept."""
        if self._closed:
            return None
        if not self._request_lock.acquire(blocking=False):  # a get in flight: ask again soon
            return now + linger.BUSY_RETRY_S
        try:
            with self._lock:
                next_deadline = float(lib.aib_remembered_expire(self.table, now, self._pool_linger))
                _close_templates(self._take_forgotten_locked())
        finally:
            self._request_lock.release()
        return None if next_deadline < 0 else next_deadline


def _name_bytes(name: str) -> bytes:
    """A name as the C set keys it: any ``str`` (``import_message`` takes any), one to one."""
    return name.encode("utf-8", "surrogatepass")


def _close_templates(forgotten: Sequence[RememberedMessage | None]) -> None:
    """Close the templates of remembered messages just forgotten (None: nothing was there)."""
    for remembered in forgotten:
        if remembered is not None:
            remembered.template.drop_reader_maps()  # its hold on other GPUs' mappings of its regions
            remembered.template.close()


def needs_lease(regions: list[Region]) -> bool:
    """Whether keeping these regions imported needs a lease: a pool allocation the producer may
    free (one not flagged kept), which CUDA wants freed here first."""
    return any(r.kind == REGION_CUDA_POOL and not r.flags & REGION_FLAG_KEPT for r in regions)
