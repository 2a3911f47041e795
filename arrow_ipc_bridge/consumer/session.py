"""Consumer side: decode -> validate -> map -> rebuild, and the connection to a publisher.

A :class:`Session` is the consumer's local session. On its own it imports messages that arrived
over the user's channel (:meth:`Session.import_message`); made by :func:`connect`, it also talks to
a :class:`~arrow_ipc_bridge.producer.publisher.Publisher` (``list``, ``get``) and gives each lease back when
the last struct built from it is released. The messages it remembers for re-gets, with their
regions open, are kept by :class:`~arrow_ipc_bridge.consumer.remembered.RememberedMessages`.

One concern: the consumer's session, made by :func:`connect` (and
:func:`subscribe`), and its get paths, which share the request lock, the remembered set and the
leases. What stands apart from that state lives beside it: the Python import of a message
(``consumer/message_import.py``), the remembered set (``consumer/remembered.py``), the version board
(``transport/board.py``), kept CuPy arrays (``consumer/array_cache.py``), live subscriptions
(``consumer/live_stream.py``), waits: one WAIT and its answer, and ``get_next``'s waits on the
board (``consumer/waiting.py``).
Connecting to a socket path is ``consumer/socket_connect.py``'s; choosing between the socket and
Arrow Flight, ``addresses.py``'s.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from arrow_ipc_bridge import transport
from arrow_ipc_bridge._ffi import WIRE_VERSION, ffi, lib
from arrow_ipc_bridge.consumer import linger, region_import, waiting
from arrow_ipc_bridge.consumer.array_cache import KeptCupyArrays
from arrow_ipc_bridge.consumer.content_check import check_level
from arrow_ipc_bridge.consumer.imported import ImportedArray, ImportedStream
from arrow_ipc_bridge.consumer.live_stream import LiveStream, open_subscription
from arrow_ipc_bridge.consumer.local_getter import new_local_getter
from arrow_ipc_bridge.consumer.message_import import ImportedRefs, MessageImporter, track
from arrow_ipc_bridge.consumer.remembered import RememberedMessages
from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    ClosedError,
    LimitError,
    PeerClosedError,
    ProtocolError,
)
from arrow_ipc_bridge.host.mappings import HostMappingCache
from arrow_ipc_bridge.process_stats import import_counters
from arrow_ipc_bridge.runtime import arguments, process, reaper
from arrow_ipc_bridge.transport import protocol
from arrow_ipc_bridge.transport.board import SessionBoard, open_board
from arrow_ipc_bridge.transport.channel import Channel, Frame, millis
from arrow_ipc_bridge.transport.stream_frames import MAX_IN_FLIGHT

if TYPE_CHECKING:
    from arrow_ipc_bridge.cuda.cross_gpu import ReaderPlacement

__all__ = ["Session"]

Imported = ImportedArray | ImportedStream


class _Lease:
    """The release notice of a lease imported by Python (the first get of a message): sends RELEASE
    when its owner dies. Leases the C core imports use the session's reaper family instead."""

    __slots__ = ("channel", "lease_id")

    def __init__(self, channel: Channel, lease_id: int) -> None:
        self.channel = channel
        self.lease_id = lease_id

    def __call__(self) -> None:
        _send_release(self.channel, self.lease_id)


class Session:
    """The consumer's session: imports messages, maps their regions once, hands out imported objects.

    Parameters
    ----------
    mapping_cache_size
        How many zero-copy file mappings to keep for reuse across imports.
    pool_linger
        Seconds this session keeps one lease per name it re-gets after that name's last get
        (``docs/lifetime.md``, 5a and 5b): a remembered IPC-pool message's kept lease, and the
        *standing lease* under which re-gets of a name import its remembered message in place
        while the publisher's version board shows the same publication, with no round trip (from
        a name's second get on, with a publisher offering feature ``"board"``; a new publish, an
        unpublish, a closed or dead publisher, or anything waiting on the connection make the get
        ask). The lease is given back ``pool_linger`` seconds after the name's last get, on
        :meth:`forget`, when the name is got with other data, or on :meth:`close`; the publisher
        counts it in ``active_leases`` meanwhile, also after the user released every import.
        While it stands, ``column_arrays(..., "cupy")`` hands out the CuPy arrays it made for the
        name's remembered message again while nothing else holds them (``docs/lifetime.md``,
        "Kept CuPy arrays"). ``0`` keeps no lease: every get asks the publisher and every release
        gives its lease back at once (for a producer that must reclaim memory as soon as its
        consumers release it).
    remembered_messages
        How many messages the session remembers for re-gets through the C core (one per name: the
        one it was last got with), least recently used out first. Each holds its regions open (host
        mappings, CUDA handles; the leases of ``pool_linger``). More names than this got in a cycle
        miss every time and take the Python import path: size it to the names a loop re-gets. 0
        remembers nothing (and so keeps no standing lease).
    check
        How far the contents of an import's buffers are checked before it is handed out
        (``docs/wire-format.md``, "Content checks"): ``"full"`` (every offset, view, dictionary
        index, union type id and offset, run end a reader follows), ``"bounds"`` (O(1) per array:
        enough for ``pyarrow``'s ``validate(full=True)`` to be safe and catch the rest) or
        ``"none"`` (structure only: for a producer this consumer trusts). ``None`` (the default)
        is ``"full"`` for host data and ``"none"`` for CUDA data, whose check costs device-to-host
        reads. A failing check raises :class:`~arrow_ipc_bridge.errors.ProtocolError`.
    reader_device
        The GPU (this process's ordinal) this consumer's work runs on, or ``None`` (the default:
        GPU data is handed out where it lives, nothing else is done). When set, CUDA data living
        on another GPU is handled by ``cross_device`` (``docs/gpu.md``, "Several GPUs").
    cross_device
        ``"peer"`` (the default): the object is handed out as it is, after the reader's GPU was
        given access to its memory (peer access, once per pair; IPC-pool and VMM access per
        pool / mapping), so kernels on ``reader_device`` read it in place over NVLink or PCIe;
        :class:`~arrow_ipc_bridge.errors.CudaError` (``reason="no_peer_access"``) when the pair has
        no peer path.
        ``"copy"``: a copy on ``reader_device`` is handed out (``ImportedArray.to_device``) and
        the import released once the copies ran.
    copy_stream
        The stream of ``reader_device`` the copies of ``cross_device="copy"`` are queued on (CuPy /
        PyTorch stream or ``CUstream``); ``None``: its legacy default stream.
    removed
        No keyword argument is accepted here: ``standing_leases`` (earlier versions' switch;
        standing leases are the default now) raises ``TypeError`` naming ``pool_linger=0``, any
        other unknown name ``TypeError`` as Python's own.

    Examples
    --------
    >>> import pyarrow as pa, arrow_ipc_bridge as aib
    >>> exported = aib.export(pa.record_batch({"x": [1, 2]}))
    >>> with aib.Session() as session:
    ...     with session.import_message(exported.message, exported.fds) as imported:
    ...         pa.record_batch(imported).num_rows
    2
    >>> exported.close()
    """

    route = "local"
    """How this session reaches its publisher: ``"local"``, the Unix socket (a session
    :func:`connect` made for a ``grpc://`` address over Flight is a ``FlightSession``, ``"flight"``)."""
    route_reason = ""
    """Why that route, for a session :func:`connect` made for a ``grpc://`` address."""

    def __init__(
        self,
        *,
        mapping_cache_size: int = 256,
        pool_linger: float = 1.0,
        remembered_messages: int = 64,
        check: str | None = None,
        reader_device: int | None = None,
        cross_device: str = "peer",
        copy_stream: object = None,
        **removed: NoReturn,
    ) -> None:
        arguments.refuse_removed(removed, "Session()")
        self._reader: ReaderPlacement | None = None
        if reader_device is not None:
            from arrow_ipc_bridge.cuda.cross_gpu import ReaderPlacement

            self._reader = ReaderPlacement(reader_device, cross_device, copy_stream)
        elif cross_device != "peer" or copy_stream is not None:
            raise ValueError("cross_device and copy_stream need reader_device (the consumer's GPU)")
        self._host_check = "full" if check is None else check_level(check)
        self._cuda_check = "none" if check is None else self._host_check
        pool_linger = arguments.seconds(pool_linger, "pool_linger")
        remembered_messages = arguments.count(remembered_messages, "remembered_messages", least=0)
        mapping_cache_size = arguments.count(mapping_cache_size, "mapping_cache_size", least=0)
        self._pid = process.pid  # a forked child inherits this object; it may not use it
        self._cache = HostMappingCache(mapping_cache_size)
        # Lock order: _request_lock, then the remembered set's own (see RememberedMessages).
        self._request_lock = threading.Lock()
        reader = self._reader
        self._remembered = RememberedMessages(
            remembered_messages,
            float(pool_linger),
            self._request_lock,
            # messages on another GPU are remembered as the reader reads them in place
            reader=reader.device if reader is not None and reader.mode == "peer" else None,
        )
        self._pool_linger = float(pool_linger)
        # CuPy arrays column_arrays made for this session's re-gets, handed out again while unheld
        # (consumer/array_cache.py): a standing lease already keeps what they hold for pool_linger, so they
        # exist exactly when standing leases may (pool_linger 0 keeps neither).
        self._kept_arrays = KeptCupyArrays(self._pool_linger) if self._pool_linger > 0 else None
        # The publisher's version board once connected (transport/board.py); None: every get asks.
        self._board: SessionBoard | None = None
        # Whether the publisher offers a board this session has not mapped yet (see _attach).
        self._board_wanted = False
        # get_next's waits on the board (consumer/waiting.py) when the publisher wakes its slots' sleepers.
        self._board_waits: waiting.BoardWaits | None = None
        # The imports this session handed out (close() releases those alive): consumer/message_import.py.
        self._imported: ImportedRefs = set()
        self._importer = MessageImporter(
            self._cache,
            self._remembered,
            self._imported,
            host_check=self._host_check,
            cuda_check=self._cuda_check,
        )
        self._conn: transport.Connection | None = None
        self._channel: Channel | None = None  # the C side of the connection once the handshake is done
        self._path: str | None = None  # the publisher's socket (connect), for subscriptions
        # Leases imported by the C core name their owner with token ``_lease_tokens | lease id`` (a
        # reaper family: no Python call per get) and hold _lease_keeper, whose death (this session
        # closed or collected, and every such lease ended) retires the family. Set in _attach.
        self._lease_tokens = 0
        self._lease_keeper: Any = ffi.NULL
        self._timeout: float | None = None
        self._timeout_ms = -1
        self._closed = False
        self._waiting: set[int] = set()  # threads in get_next / get(wait=): close() wakes them
        self.publisher_info: dict[str, object] = {}
        # This session's gets answered from the board (get_next tells a local get from a round trip
        # by it: _local_get_count); the process-wide counts are aib.stats().session's.
        self._local_gets = 0  # by _get_now
        # The C core's local re-gets (py_local_get.c) once connected with a version board: the
        # getter (which counts its own gets), and its builtin get(name) -> import or None.
        self._local_getter: Any = None
        self._local_get: Any = None

    def _local_get_count(self) -> int:
        """This session's gets answered from the board, by either path."""
        getter = self._local_getter
        return self._local_gets + (0 if getter is None else int(getter.gets))

    # ---------- local import ------------------------------------------------------------------------
    def import_message(self, message: bytes, fds: Sequence[int] = (), *, name: str | None = None) -> Imported:
        """Import a message that arrived with ``fds`` (borrowed: the caller still owns and closes them).

        Raises :class:`ProtocolError` for a malformed message or a region that cannot be mapped as
        described, :class:`RegionError` when the system refuses the mapping; nothing is leaked
        either way.
        """
        self._check_open()
        message = arguments.byte_string(message, "message")
        arguments.optional_name(name, "name", protocol.MAX_NAME)
        imported = self._import(message, region_import.checked_fds(fds), name=name, token=0)
        return imported if self._reader is None else self._place(imported)

    def _import(self, message: bytes, fds: Sequence[int], *, name: str | None, token: int) -> Imported:
        """``message`` imported in Python (``consumer/message_import.py``) under the lease ``token``
        (0: none)."""
        self._check_open()
        fetch_pool_fd = self._fetch_pool_fd if self._channel is not None else None
        return self._importer.import_message(
            message, fds, name=name, token=token, fetch_pool_fd=fetch_pool_fd
        )

    def _place(self, imported: Imported) -> Imported:
        """``imported`` placed for the reader GPU (``cross_gpu.ReaderPlacement``); a new object
        (mapped on the reader, or a copy there) joins the imports :meth:`close` releases."""
        assert self._reader is not None
        placed: Imported = self._reader.place(imported)
        if placed is not imported:
            track(self._imported, placed)
        return placed

    def forget(self, name: str | None = None) -> int:
        """Forget remembered messages: the one last got as ``name``, or all of them (None).

        Their regions close once no import uses them, and IPC-pool messages give their kept lease
        back now instead of ``pool_linger`` seconds after their last get. The next get of the same
        data decodes and opens again. Returns how many messages were forgotten.
        """
        self._check_open()
        name = arguments.optional_name(name, "name", protocol.MAX_NAME)
        if self._kept_arrays is not None:
            self._kept_arrays.forget(name)
        forgotten = self._remembered.forget(name)
        reaper.drain()
        return forgotten

    # ---------- publisher conversation --------------------------------------------------------------
    def _attach(self, conn: transport.Connection, timeout: float) -> None:
        self._conn = conn
        self._timeout = timeout
        self._timeout_ms = millis(timeout)
        channel = conn.channel  # every frame goes through the C core, the handshake's too
        # A publisher that refused us (uid, connection limit) closed at once: its ERROR frame may be
        # waiting to be read even when the HELLO could not go out.
        with contextlib.suppress(PeerClosedError):
            channel.send(protocol.HELLO, protocol.encode_hello(), timeout=timeout)
        frame = channel.recv(timeout=timeout)
        frame.close_fds()
        if frame.kind == protocol.ERROR:
            protocol.raise_error(frame.payload)
        if frame.kind != protocol.WELCOME:
            raise ProtocolError(f"expected WELCOME, got frame kind {frame.kind}")
        info = protocol.decode_json(frame.payload, "WELCOME")
        if not isinstance(info, dict):
            raise ProtocolError("WELCOME payload is not an object")
        wire = info.get("wire")
        if not isinstance(wire, list) or len(wire) != 2 or wire[0] != WIRE_VERSION[0]:
            raise ProtocolError(
                f"the publisher speaks wire format {wire}, this session {list(WIRE_VERSION)}: "
                "the major versions must match (upgrade one side)"
            )
        self.publisher_info = info
        self._channel = channel
        # The family's callback holds the channel, so a lease outliving the session can still be
        # given back; the keeper's death retires it (then the channel can close with the session).
        tokens = reaper.register_family(functools.partial(_send_release, channel))
        keeper = lib.aib_owner_new(reaper.register(functools.partial(reaper.unregister_family, tokens)))
        if keeper == ffi.NULL:
            reaper.unregister_family(tokens)
            raise MemoryError("allocating the session's lease keeper")
        self._lease_tokens = tokens
        self._lease_keeper = ffi.gc(keeper, lib.aib_owner_unref)
        features = info.get("features")
        # Standing leases (docs/lifetime.md, 5b) whenever they can be kept: the board tells a
        # re-get whether its remembered message is still the publication, with no round trip.
        self._board_wanted = (
            isinstance(features, list)
            and "board" in features
            and self._pool_linger > 0
            and bool(self._remembered.limit)
        )
        if self._board_wanted:
            # The kernel may refuse the answer's descriptor while the publisher's user has too many
            # in flight to peers that do not read: the connection goes on, and the board is asked
            # for again before the next get, which raises that error while it lasts.
            try:
                self._take_board(channel, timeout)
            except LimitError as exc:
                if exc.limit != "descriptors_in_flight":
                    raise

    def _take_board(self, channel: Channel, timeout: float) -> None:
        """Map the publisher's version board and set up what uses it: ``get_next``'s waits on it
        and the C core's local getter. Called while no other request can run (in :meth:`_attach`,
        or holding ``_request_lock``)."""
        board = open_board(channel, timeout)
        features = self.publisher_info.get("features")
        self._board = board
        self._board_wanted = False
        if isinstance(features, list) and "board_wake" in features and "watch" in features:
            self._board_waits = waiting.BoardWaits(board, self._remembered)
        self._local_getter = new_local_getter(
            channel,
            board,
            self._remembered,
            request_lock=self._request_lock,
            kept_arrays=self._kept_arrays,
            imported=self._imported,
        )
        self._local_get = self._local_getter.get

    def _ask_board_again(self, channel: Channel) -> None:
        """The board a ``LimitError`` (``limit="descriptors_in_flight"``) kept from this session at
        connect, asked for again before a get; that error again while the kernel still refuses."""
        timeout = self._timeout
        assert timeout is not None  # _attach set it before it could want the board
        with self._request_lock:
            if self._board_wanted and not self._closed:
                self._take_board(channel, timeout)

    def _request(self, kind: int, payload: bytes) -> Frame:
        channel = self._connection()
        with self._request_lock:
            # Any failure closes the connection: after a timeout a late reply would be read as the
            # answer to the next request.
            frame = channel.request(kind, payload, timeout=self._timeout)
        if frame.kind == protocol.ERROR:
            frame.close_fds()
            protocol.raise_error(frame.payload)
        return frame

    def _fetch_pool_fd(self, identity: bytes) -> int:
        """The fd of the producer's IPC pool ``identity`` names (POOL_FD), for a message that left
        it out; the caller closes it. Asked once per pool per process (the opener caches pools)."""
        features = self.publisher_info.get("features")
        if not isinstance(features, list) or "pool_fd" not in features:
            raise ProtocolError(
                "the publisher sent an IPC-pool region without its pool's fd but does not serve pool fds"
            )
        frame = self._request(protocol.POOL_FD, identity)
        if frame.kind != protocol.POOL or frame.payload != identity or len(frame.fds) != 1:
            frame.close_fds()
            raise ProtocolError(
                f"expected POOL with the asked identity and one fd, got frame kind {frame.kind} "
                f"with {len(frame.fds)} fds"
            )
        return frame.fds.pop()  # ours now

    def list(self) -> list[str]:
        """Names the publisher currently serves."""
        frame = self._request(protocol.LIST, b"")
        frame.close_fds()
        if frame.kind != protocol.NAMES:
            raise ProtocolError(f"expected NAMES, got frame kind {frame.kind}")
        names = protocol.decode_json(frame.payload, "NAMES")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ProtocolError("NAMES payload is not a list of strings")
        return names

    def ping(self, payload: bytes = b"") -> float:
        """One round trip with a frame the publisher echoes from its C loop; returns the seconds it took.

        A liveness check (a dead publisher raises :class:`~arrow_ipc_bridge.errors.PeerClosedError`,
        a stuck one :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError`, like any request), and
        the floor a ``get`` is measured against: the same connection, nothing imported.
        ``payload``: at most ``protocol.MAX_PING`` bytes, which must come back unchanged.
        """
        self._check_open()
        payload = arguments.byte_string(payload, "payload", max_bytes=protocol.MAX_PING)
        features = self.publisher_info.get("features")
        if not isinstance(features, list) or "ping" not in features:
            self._connection()  # not connected / closed: that error first
            raise BridgeError("this publisher does not answer PING (an older version): upgrade it")
        started = time.perf_counter()
        frame = self._request(protocol.PING, payload)
        elapsed = time.perf_counter() - started
        frame.close_fds()
        if frame.kind != protocol.PONG or frame.payload != payload:
            raise ProtocolError(f"expected PONG with the PING's payload, got frame kind {frame.kind}")
        return elapsed

    def get(self, name: str, *, wait: float | None = None) -> Imported:
        """Import the object published as ``name`` under a lease.

        ``wait``: seconds to wait for ``name`` to be published when it is not (yet); the publisher
        answers as soon as it is (no polling), or
        :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` when the time is up (the session stays
        usable). ``0`` does not wait but still answers with the version; the object's ``version``
        and ``publisher_id`` say what was got (see :meth:`get_next`). Needs a publisher offering
        ``"watch"``. Without ``wait`` (the default) an unknown name raises at once.

        The lease ends when the returned object is released (``release()``, the ``with`` block, or
        garbage collection) and every struct a consumer built from it is released too.
        Raises :class:`~arrow_ipc_bridge.errors.NotPublishedError` for an unknown name.

        Re-gets of the same publication are the steady state: the session remembers the message
        with its regions open and the C core imports it without Python work (legacy CUDA handles,
        host files). From a name's second get on, the session keeps one more lease on what it got
        (a *standing lease*; for IPC-pool data the lease that keeps the producer's memory while the
        pointers stay imported here, as CUDA requires the importer to free first), and while the
        publisher's version board shows the same publication a re-get imports it with no round
        trip. That lease is given back ``pool_linger`` seconds after the name's last get, when the
        name is got with other data, on :meth:`forget`, or on :meth:`close`; ``pool_linger=0``
        keeps none (``docs/lifetime.md``, 5a and 5b).
        """
        if wait is None:
            local_get = self._local_get
            if local_get is not None:  # the steady state, in one C call (py_local_get.c)
                imported = local_get(name)
                if imported is not None:
                    return imported if self._reader is None else self._place(imported)
        channel = self._connection()  # closed, not connected: before the arguments
        if wait is not None:
            imported = self._get_version(name, after=0, timeout=waiting.check_wait(wait, "wait"))
        else:
            imported = self._get_now(channel, name)
        return imported if self._reader is None else self._place(imported)

    def _get_local_first(self, channel: Channel, name: str) -> Imported:
        """:meth:`_get_now`, through the C core's local getter first when there is one."""
        local_get = self._local_get
        imported = local_get(name) if local_get is not None else None
        return imported if imported is not None else self._get_now(channel, name)

    def _get_now(self, channel: Channel, name: str) -> Imported:
        """:meth:`get` without waiting, before the reader's placement (``cross_gpu.py``), when the
        local getter did not answer. One C call (``aib_session_get``) answers from the publisher's
        version board when it can, or else asks the publisher; it imports a remembered message
        itself (what is left here is wrapping its owner), and a new message whose regions are all
        open here. Any other answer is imported in Python."""
        raw_name = protocol.encode_name(name)
        if self._board_wanted:
            self._ask_board_again(channel)
        with self._request_lock:
            imported_now, frame = channel.get(
                raw_name,
                self._remembered.table,
                self._lease_tokens,
                self._lease_keeper,
                board=self._board,
                timeout_ms=self._timeout_ms,
            )
            if imported_now is not None and imported_now[0] != 0:
                # Changes to the remembered set wait for _request_lock: the entry is here.
                return self._adopt_remembered(name, imported_now)
        if imported_now is not None:
            assert frame is not None
            return self._adopt_new(imported_now, protocol.answer_message(frame.kind, frame.payload), name)
        assert frame is not None
        try:
            if frame.kind == protocol.ERROR:
                protocol.raise_error(frame.payload)
            if frame.kind == protocol.BOARD_ITEM and self._board is not None:
                lease_id, version, message = protocol.decode_board_item(frame.payload, self._board.n_slots)
            elif frame.kind == protocol.ITEM:
                (lease_id, message), version = protocol.decode_item(frame.payload), 0
            else:
                raise ProtocolError(f"expected ITEM, got frame kind {frame.kind}")
            lease = _Lease(channel, lease_id)
            token = reaper.register(lease)
            try:
                imported = self._import(message, frame.fds, name=name, token=token)
            except BaseException:
                # If the owner never came to life, nobody else will give the lease back.
                if reaper.unregister(token):
                    lease()
                raise
        finally:
            frame.close_fds()  # the mappings keep the files alive
        if version:
            imported.version = version
        return imported

    def _adopt_remembered(self, name: str, imported_now: tuple[int, Any, int, Any, int, int]) -> Imported:
        """The steady state's import: a remembered message the C core imported already (from the
        board, or from the answer), wrapped by the remembered message (``RememberedMessage.adopt``,
        the C function ``py_local_get.c`` builds with too). The owner's token, or the standing
        lease it holds, ends the lease when it dies. Called holding ``_request_lock``."""
        entry_id, owner, address, sync_slot, version, flags = imported_now
        hit = self._remembered.used_by_c_core(entry_id)
        if hit is None:  # cannot happen; if it did, the lease ends here
            lib.aib_owner_unref(owner)
            reaper.drain()
            raise BridgeError("a remembered message vanished during a get")
        # The C function the local getter builds with (py_state.c): the owner held as Decoded
        # holds it, the event's slot or NULL.
        imported: Imported = hit.adopt(
            ffi.gc(owner, lib.aib_owner_unref), sync_slot or ffi.NULL, name, address
        )
        next(import_counters.remembered_gets)
        if flags & _GET_LOCAL:
            self._local_gets += 1
            next(import_counters.local_gets)
        elif flags & _GET_STANDING:  # the message holds a standing lease now: its linger runs
            linger.watch(self._remembered)
        if version:
            imported.version = version
        if self._kept_arrays is not None:
            imported._kept_arrays = (self._kept_arrays, hit)
        track(self._imported, imported)
        return imported

    def get_next(self, name: str, *, after: int, timeout: float | None, spin: float = 0.0) -> Imported:
        """Wait for a version of ``name`` newer than ``after`` and import the newest one.

        ``after`` is the ``version`` of an object got before from this publisher (with ``wait=`` or
        ``get_next``), or 0 for any version. The publisher answers as soon as it has a newer one
        (it holds the request: no polling); versions published while the consumer was busy are
        skipped, the newest is returned. ``timeout``: seconds (``None``: no limit); when it runs
        out, :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` and the session stays usable. The
        returned object's ``version`` is the one to pass as ``after`` next time.

        Versions are a publisher's own: after a reconnect to a new publisher (another
        ``publisher_id``) they start again at 1, so wait with ``after=0`` there
        (``docs/lifetime.md``, "Waiting and publisher restarts"). Needs a publisher offering
        ``"watch"``. While a wait is held this session sends no other request (one at a time);
        use another session to get other names meanwhile.

        While the name's gets are local (a standing lease: its
        second plain get on, or once two WAIT answers named the same memory, as in-place renewals
        do), a wait for ``after`` > 0 sends nothing: it sleeps on the name's slot of the
        publisher's version board, which the publisher's next publish of the name wakes, and then
        gets the name (feature ``"board_wake"``; ``docs/lifetime.md``, "Waiting on the version
        board"). New data every version goes on with held WAITs. Other threads may use the
        session meanwhile. A publisher that dies or closes meanwhile is noticed within 50 ms (its
        connection is checked between sleeps). ``spin``: seconds to poll the slot before sleeping
        (a busy core, and no wake-up to wait for when the version comes within them: for step
        loops whose next version is due soon); 0, the default, sleeps at once. Only a wait on the
        board spins.
        """
        self._connection()  # closed, not connected: before the arguments
        imported = self._get_version(
            name,
            after=waiting.check_after(after),
            timeout=waiting.check_wait(timeout, "timeout"),
            spin=arguments.seconds(spin, "spin", maximum=waiting.MAX_WAIT),
        )
        return imported if self._reader is None else self._place(imported)

    def _get_version(self, name: str, *, after: int, timeout: float | None, spin: float = 0.0) -> Imported:
        """WAIT for a version over ``after`` (``consumer/waiting.py``), then import it like a GET's answer;
        a version over ``after`` > 0 of a name whose gets are local is waited for on the board."""
        raw_name = protocol.encode_name(name)
        if self._board_wanted:
            self._ask_board_again(self._connection())
        board_waits = self._board_waits
        if after and board_waits is not None:
            channel = self._connection()
            imported, timeout = board_waits.next_version(
                name,
                raw_name,
                after=after,
                timeout=timeout,
                spin=spin,
                channel=channel,
                get=lambda: self._get_local_first(channel, name),
                closed=lambda: self._closed,
                local_gets=self._local_get_count,
            )
            if imported is not None:
                self._stamp_publisher(imported)
                return imported
        me = threading.get_ident()
        self._waiting.add(me)  # before the closed check: close() either sees us or we see it closed
        try:
            channel = self._connection()
            features = self.publisher_info.get("features")
            if not isinstance(features, list) or "watch" not in features:
                raise BridgeError(
                    'this publisher cannot wait for names or versions (it does not offer the "watch" '
                    "feature: an older version): upgrade it, or get without waiting"
                )
            answer = waiting.wait_for_version(
                channel, self._request_lock, raw_name, after=after, timeout=timeout, grace=self._timeout
            )
        finally:
            self._waiting.discard(me)
        if board_waits is not None:  # (before the import closes the answer's descriptors)
            board_waits.note_answer(raw_name, answer.message, answer.frame.fds)
        return self._import_versioned(channel, answer, name)

    def _stamp_publisher(self, imported: Imported) -> None:
        publisher_id = self.publisher_info.get("publisher_id")
        imported.publisher_id = publisher_id if isinstance(publisher_id, str) else None

    def _import_versioned(self, channel: Channel, answer: waiting.Versioned, name: str) -> Imported:
        """Import a wait's answer like a GET's ITEM (its lease given back when the import dies)."""
        frame = answer.frame
        try:
            lease = _Lease(channel, answer.lease_id)
            token = reaper.register(lease)
            try:
                imported = self._import(answer.message, frame.fds, name=name, token=token)
            except BaseException:
                if reaper.unregister(token):  # the owner never came to life: give the lease back
                    lease()
                raise
        finally:
            frame.close_fds()  # the mappings hold the files open
        imported.version = answer.version
        self._stamp_publisher(imported)
        return imported

    def _import_new_in_c(self, message: bytes, token: int, name: str) -> Imported | None:
        """``message`` (no descriptors), imported by the C core under the lease ``token`` when every
        region it names is open in this process, as a GET's answer is (``aib_import_new``: CUDA
        data carved out of allocations opened before); None when it cannot be (anything else: the
        caller takes :meth:`_import`, which reports errors properly). A live stream's fresh
        batches come here."""
        if self._lease_keeper == ffi.NULL:
            return None  # not connected: no lease family to hold
        owner = lib.aib_import_new(message, len(message), 0, token, self._lease_keeper)
        if owner == ffi.NULL:
            return None
        slot = lib.aib_owner_slot(owner)
        address = int(ffi.cast("uintptr_t", owner))
        return self._adopt_new((0, owner, address, slot if slot[0] else None, 0, 0), message, name)

    def _adopt_new(
        self, imported_now: tuple[int, Any, int, Any, int, int], message: bytes, name: str
    ) -> Imported:
        """The import of a message the C core made because all its regions are open in this process
        (``aib_import_new``), wrapped (``consumer/message_import.py``)."""
        return self._importer.adopt_new(imported_now, message, name, self._lease_keeper)

    def subscribe(self, name: str, *, max_in_flight: int = 8, timeout: float | None = None) -> LiveStream:
        """Subscribe to the publisher's live stream ``name`` from now on (docs/streams.md).

        The subscription runs on a connection of its own to the same publisher, so its batches
        never interleave with this session's requests. ``max_in_flight``: batches this consumer
        may hold unreleased (the publisher may grant fewer); ``timeout``: seconds each batch is
        waited for (None: forever). Raises :class:`~arrow_ipc_bridge.errors.NotPublishedError`
        when no such stream is open.
        """
        self._connection()
        if self._path is None:
            raise BridgeError(
                "this session was not made by connect(): use arrow_ipc_bridge.subscribe(path, name)"
            )
        protocol.encode_name(name)
        max_in_flight = arguments.count(max_in_flight, "max_in_flight", least=1, most=MAX_IN_FLIGHT)
        timeout = arguments.optional_seconds(timeout, "timeout")
        check = None if self._host_check == "full" and self._cuda_check == "none" else self._host_check
        connect_timeout = self._timeout if self._timeout is not None else 5.0
        # The subscription's own connection to the same publisher; remembered_messages: one per
        # reserved slot of the stream.
        subscriber = Session(remembered_messages=1024, check=check)
        subscriber._path = self._path
        try:
            subscriber._attach(transport.connect(self._path, timeout=connect_timeout), connect_timeout)
        except BaseException:
            subscriber.close()
            raise
        return open_subscription(
            subscriber, name, max_in_flight=max_in_flight, timeout=timeout, request_timeout=connect_timeout
        )

    def _connection(self) -> Channel:
        self._check_open()
        if self._channel is None:
            raise BridgeError(
                "this session is not connected to a publisher: use arrow_ipc_bridge.connect(path)"
            )
        return self._channel

    # ---------- lifetime ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._pid != process.pid:
            raise process.foreign(
                "session",
                self._pid,
                "connect again here (imported objects the child inherited stay readable)",
            )
        if self._closed:
            raise ClosedError("this session is closed: connect again (or make a new Session)", what="session")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mapping_cache(self) -> HostMappingCache:
        return self._cache

    def close(self) -> None:
        """Release every imported object this session handed out and close the connection (idempotent).

        Structs that consumers (pyarrow, polars, ...) already hold stay mapped: they keep their own
        references on the mapped memory. The publisher ends this session's leases when it sees the
        connection close, so memory it may reuse (CUDA IPC-pool allocations) should be released
        before; remembered messages are forgotten first, kept pool leases given back after their
        imports are freed.
        """
        if self._closed:
            return
        self._closed = True
        if self._local_getter is not None:  # answers nothing from now on (before any teardown)
            self._local_getter.close()
            self._local_get = None
        if self._waiting and self._channel is not None and self._pid == process.pid:
            # A wait held by the publisher holds the request lock for its whole time: end it now
            # (it raises PeerClosedError). The publisher then ends this connection's leases at once.
            self._channel.close()
        if self._pid != process.pid:
            # A fork child's copy: the leases, the remembered messages and the connection are the
            # parent's (and its locks may have been held at the fork). Only our descriptor goes.
            if self._conn is not None:
                self._conn.close()
            return
        for imported_ref in list(self._imported):
            imported = imported_ref()
            if imported is not None:
                imported.release()
        if self._kept_arrays is not None:
            self._kept_arrays.close()
        self._remembered.close()
        # While the connection is open: pool imports are freed and kept leases given back in that
        # order (the producer frees its memory only after the importer did).
        reaper.drain()
        if self._conn is not None:
            self._conn.close()
        if self._lease_keeper != ffi.NULL:
            ffi.release(self._lease_keeper)  # the family retires once the last C-imported lease ends
        if self._board is not None or self._board_wanted:
            with self._request_lock:  # no get reads the page meanwhile (nor maps it: _closed is set)
                if self._board is not None:
                    self._board.close()
        self._cache.close()
        reaper.drain()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_GET_LOCAL = int(lib.AIB_GET_LOCAL)
_GET_STANDING = int(lib.AIB_GET_STANDING)


def _send_release(channel: Channel, lease_id: int) -> None:
    if channel.closed:
        return  # the publisher released this connection's leases when it closed
    # A publisher that is gone has nothing left to release.
    with contextlib.suppress(PeerClosedError, BridgeTimeoutError, OSError):
        channel.send(protocol.RELEASE, protocol.encode_lease(lease_id), timeout=5.0)
