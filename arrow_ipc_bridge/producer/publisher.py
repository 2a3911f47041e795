"""Producer side server: publish named Arrow objects, serve them to sessions under leases.

Each published name holds an :class:`~arrow_ipc_bridge.producer.exporter.Exported` (captured data, its region
fds and the encoded message, made once at publish time, so a ``get`` costs one frame). The names,
messages and leases live in the C core (``cffi_build/serve.c``), whose serve loop answers GET and
RELEASE (and PING) frames without the GIL; this module handles the handshake, LIST, errors and the
limits. An entry, and with it the producer's buffers, lives until it is unpublished *and* every
lease on it ended; then its keeper owner dies and the reaper closes the export record. A session
that disconnects or dies gives back all its leases at once (its connection's lease table is freed
when the socket closes).

A connection holds a thread only while it is active: one idle for ``park_after`` seconds is handed
back, its leases intact, to the server's parking lot (one thread watching every parked connection),
and gets a thread again when it sends. New connections wait there for their HELLO.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

from arrow_ipc_bridge import process_stats, transport
from arrow_ipc_bridge._ffi import WIRE_VERSION, ffi, lib, new_error, raise_for
from arrow_ipc_bridge.errors import (
    BridgeError,
    ClosedError,
    LimitError,
    NotPublishedError,
    ProtocolError,
    RegionError,
    not_published_message,
)
from arrow_ipc_bridge.producer.exporter import (
    CopyPolicy,
    Exported,
    ExportStats,
    copy_policy,
    export_again,
    record_in_place,
)
from arrow_ipc_bridge.producer.stream_hub import MAX_SUBSCRIPTIONS, LiveStreamState, StreamHub
from arrow_ipc_bridge.producer.stream_slots import SlotLayout
from arrow_ipc_bridge.producer.stream_writer import StreamWriter, check_source, pump
from arrow_ipc_bridge.producer.watch import HeldWait, WaitingConnection, Watch
from arrow_ipc_bridge.runtime import arguments, process, reaper
from arrow_ipc_bridge.transport import protocol, stream_frames
from arrow_ipc_bridge.transport.board import PublisherBoard, encode_board
from arrow_ipc_bridge.transport.channel import MAX_FDS, Channel, Frame, frame_from, millis
from arrow_ipc_bridge.wire.capsules import ArrowInput

__all__ = ["Publisher"]

_log = logging.getLogger("arrow_ipc_bridge")

MAX_CONNECTIONS = 512
"""Default ``max_connections``: connections a publisher serves at once."""
MAX_CONNECTIONS_PER_PROCESS = 256
"""Default ``max_connections_per_process``: connections one client process may hold at once."""
MAX_CONNECTIONS_PER_UID = 256
"""Default ``max_connections_per_uid``: connections the processes of one admitted uid other than the
publisher's may hold at once."""
HANDSHAKE_TIMEOUT = 10.0
"""Default ``handshake_timeout``, seconds from accept to HELLO answered."""
MAX_LEASES_PER_CONNECTION = 4096
"""Default ``max_leases_per_connection``."""
MAX_UNREAD_FDS = 256
"""Default ``max_unread_fds``: descriptors in answers one connection has not read (at least one
frame's worth, 253, so a client that reads is never refused)."""
MAX_WAITS_PER_CONNECTION = 16
"""Default ``max_waits_per_connection``: waits one connection may have held at once (a session
holds one at a time; each held wait keeps its name, up to 4 KiB)."""
PARK_AFTER = 5.0
"""Default ``park_after``, seconds of silence before a connection's thread is given back."""
SEND_TIMEOUT = 10.0
"""Seconds an answer may wait for room in a client's socket: a client that does not read its answers
for that long is disconnected (its thread is not held forever)."""


class _Served:
    """What the publisher keeps for one connection between its serving threads: the C channel and
    the C lease table (freed when the connection closes)."""

    __slots__ = ("channel", "served", "waiting", "welcomed")

    def __init__(self, channel: Channel, served: Any) -> None:
        self.channel = channel
        self.served = served
        self.welcomed = False
        self.waiting = WaitingConnection(channel, served)  # its held waits' answers (producer/watch.py)


class Publisher:
    """Serve Arrow objects by name over a Unix socket, on background threads.

    Parameters
    ----------
    path
        Socket file to create. A stale one is replaced; a live publisher's is refused. Its mode is 0600, or
        0666 when ``allowed_uids`` names uids other than this process's: every connection's ``SO_PEERCRED``
        uid is then the gate, and a peer not allowed gets ERROR
        :class:`~arrow_ipc_bridge.errors.TransportError` (``reason="rejected"``) before it is disconnected.
        The directory must be searchable by those uids.
    allowed_uids
        Extra uids allowed to connect (this process's uid always is).
    copy
        Default copy policy for :meth:`publish` (see :func:`~arrow_ipc_bridge.export`).
    max_connections
        Connections served at once (512). When all are taken, a new connection takes the slot of an idle one
        that holds nothing (parked, no lease, no held wait; or silent before HELLO) of the client process
        holding the most connections, if that process holds at least two more than the new one's; the closed
        connection gets ERROR :class:`~arrow_ipc_bridge.errors.LimitError` (``limit="max_connections"``). With
        none to close, the new connection gets LimitError and is closed.
    max_connections_per_process
        Connections one client process may hold at once (256; each session and each
        subscription is one); one more gets LimitError and is closed.
    max_connections_per_uid
        Connections the processes of one uid other than the publisher's (``allowed_uids``) may
        hold at once (256); one more gets LimitError and is closed.
    handshake_timeout
        Seconds a new connection has to say HELLO (10); later it gets ERROR
        :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` (``waiting_for="handshake"``) and is closed. Any
        other frame before HELLO is a :class:`~arrow_ipc_bridge.errors.ProtocolError` and closes it.
    max_leases_per_connection
        Leases one connection may hold (4096); a GET past it gets ERROR
        :class:`~arrow_ipc_bridge.errors.LimitError` (``limit="max_leases_per_connection"``) and the session
        goes on.
    max_unread_fds
        Descriptors in answers one connection has not read yet (256, at least 253): a client that sends GETs
        without reading the ITEMs gets ERROR :class:`~arrow_ipc_bridge.errors.LimitError`
        (``limit="max_unread_fds"``) instead of more descriptors (the kernel limits descriptors in flight per
        user; an unread client would otherwise make the answers to every other client fail). All connections
        together may have half of ``RLIMIT_NOFILE`` unread; a client that read everything is always answered.
    park_after
        Seconds a connection may stay silent before its thread is given back (5); it keeps its
        leases and gets a thread again when it sends.
    max_waits_per_connection
        Waits (``get(wait=)``, ``get_next``: WAIT frames) one connection may have held at once (16); one more
        gets ERROR :class:`~arrow_ipc_bridge.errors.LimitError` (``limit="max_waits_per_connection"``),
        nothing is held and the connection goes on. A session waits for one thing at a time, so only a client
        that sends WAITs without reading the answers meets it.
    max_subscriptions
        Live-stream subscriptions served at once (128). Each holds one publisher thread and one connection
        (counted in ``max_connections`` too) for its whole life and is never parked; one more gets ERROR
        :class:`~arrow_ipc_bridge.errors.LimitError` (``limit="max_subscriptions"``) and is closed.

    Examples
    --------
    >>> with aib.Publisher("/tmp/demo.sock") as pub:  # doctest: +SKIP
    ...     pub.publish("trades", table)
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allowed_uids: list[int] | None = None,
        copy: CopyPolicy = "if_needed",
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_leases_per_connection: int = MAX_LEASES_PER_CONNECTION,
        max_unread_fds: int = MAX_UNREAD_FDS,
        park_after: float = PARK_AFTER,
        max_subscriptions: int = MAX_SUBSCRIPTIONS,
        max_waits_per_connection: int = MAX_WAITS_PER_CONNECTION,
        max_connections_per_process: int = MAX_CONNECTIONS_PER_PROCESS,
        max_connections_per_uid: int = MAX_CONNECTIONS_PER_UID,
    ) -> None:
        path = arguments.path(path)
        allowed_uids = _uids(allowed_uids)
        copy = copy_policy(copy)
        max_connections = arguments.count(max_connections, "max_connections", least=1)
        handshake_timeout = arguments.seconds(handshake_timeout, "handshake_timeout", positive=True)
        max_leases_per_connection = arguments.count(
            max_leases_per_connection, "max_leases_per_connection", least=1
        )
        max_unread_fds = arguments.count(max_unread_fds, "max_unread_fds", least=MAX_FDS)
        park_after = arguments.seconds(park_after, "park_after", positive=True)
        max_subscriptions = arguments.count(max_subscriptions, "max_subscriptions", least=1)
        max_waits_per_connection = arguments.count(
            max_waits_per_connection, "max_waits_per_connection", least=1
        )
        self._max_per_process = arguments.count(
            max_connections_per_process, "max_connections_per_process", least=1
        )
        self._max_per_uid = arguments.count(max_connections_per_uid, "max_connections_per_uid", least=1)
        self._max_leases = max_leases_per_connection
        self._max_unread_fds = max_unread_fds
        self._park_after_ms = millis(park_after)
        self._served: dict[transport.Connection, _Served] = {}
        self._pid = process.pid  # a forked child inherits this object; it serves nothing there
        self._lock = threading.Lock()
        self._names: set[str] = set()
        # name -> its current publication's export: the next version of the name may send the same
        # message again (exporter.export_again), so consumers find the message they remember.
        self._current: dict[str, Exported] = {}
        table = lib.aib_pubtable_new()
        if table == ffi.NULL:
            raise MemoryError("allocating the publication table")
        self._table = ffi.gc(table, lib.aib_pubtable_unref)
        # The version board (transport/board.py): sessions re-get what they remember without a round trip
        # while it shows the same entry. None where the kernel cannot seal it (Linux < 5.1): the
        # publisher does not offer feature "board" then, and every get asks.
        self._board: PublisherBoard | None = None
        try:
            self._board = PublisherBoard()
        except OSError as exc:
            _log.debug("arrow_ipc_bridge: no version board (%s); every get is a round trip", exc)
        else:
            lib.aib_pubtable_set_board(table, self._board.address, self._board.n_slots)
        self._copy: CopyPolicy = copy
        # Live streams (docs/streams.md), a namespace of their own.
        self._streams = StreamHub(max_subscriptions, publications=self._published_names)
        self.publisher_id = os.urandom(16).hex()
        # Versions and held waits (feature "watch"); it asks the size of a name's answers.
        self._watch = Watch("aib-publisher", self._message_bytes, max_waits_per_connection)
        # The server accepts, and serves on its threads, from inside its constructor: before
        # self._server is assigned here. A consumer already waiting for this path (connect's
        # wait_for_publisher) is served at once, so serving waits for this to be set.
        self._constructed = threading.Event()
        try:
            self._server = self._start_server(path, allowed_uids, max_connections, handshake_timeout)
        except BaseException:
            if self._board is not None:  # its descriptor is ours until close(), which never comes
                lib.aib_pubtable_set_board(table, ffi.NULL, 0)
                self._board.close()
            raise
        self.path = self._server.path
        self._constructed.set()

    def _start_server(
        self, path: str, allowed_uids: list[int] | None, max_connections: int, handshake_timeout: float
    ) -> transport.Server:
        return transport.Server(
            path,
            self._serve,
            allowed_uids=allowed_uids,
            name="aib-publisher",
            max_connections=max_connections,
            handshake_timeout=handshake_timeout,
            park=True,
            farewell=_farewell,
            on_close=self._forget_connection,
            max_connections_per_process=self._max_per_process,
            max_connections_per_uid=self._max_per_uid,
            evictable=self._holds_nothing,
        )

    # ---------- publishing --------------------------------------------------------------------------
    def publish(self, name: str, obj: ArrowInput, *, copy: CopyPolicy | None = None) -> ExportStats:
        """Publish ``obj`` as ``name`` (replacing an earlier object of that name).

        Sessions holding leases on the replaced object keep it until they release it. Returns what
        the export cost (regions, bytes copied). CUDA data naming exactly what the current
        publication's message names (the same arrays, updated in place) is published with that
        message's bytes again, its event re-recorded after the new work (``exporter.export_again``):
        sessions import it from the message they remember. When ``obj`` is ``from_cuda_arrays``
        columns whose facts are the current version's, the publication is renewed in place (a new
        version of the same entry; nothing placed or encoded: :meth:`_renew`).

        Raises :class:`~arrow_ipc_bridge.errors.ClosedError` after :meth:`close`, and
        :class:`~arrow_ipc_bridge.errors.LimitError` (``limit="file_descriptors"``) when the process has no
        file descriptor left for the publication's region (each host publication holds one while published or
        leased): nothing is published then, and the name keeps what it had.
        """
        self._check_open()
        raw_name = protocol.encode_name(name)  # validates the name
        copy = self._copy if copy is None else copy_policy(copy)
        current = self._current.get(name)
        if current is not None and current._column_signature is not None:
            renewed = self._renew(name, raw_name, current, obj, copy)
            if renewed is not None:
                return renewed
        # Pool fds stay out of the message: a session asks for each pool's fd once (POOL_FD), so
        # the hot answers carry no descriptor for pool data. Out of descriptors: LimitError,
        # and nothing below has happened (the entry, the version and the waits are as they were).
        exported = export_again(obj, current, copy=copy, pool_fds=False, doing=f"publishing {name!r}")
        # The entry's keeper: when the last of (publication, leases) lets go, the reaper closes it.
        keeper = lib.aib_owner_new(reaper.register(exported.close))
        if keeper == ffi.NULL:
            exported.close()
            raise MemoryError("allocating a publication keeper")
        fds = list(exported.fds)
        err = new_error()
        waiting: list[HeldWait] = []  # sessions' held waits this publish answers
        # The replaced object's death is delivered on this thread (the drain below), without waking
        # the reaper thread to contend for the GIL with the publishing thread.
        lib.aib_reaper_quiet(1)
        try:
            with self._lock:
                if self._server.closed:  # closed while we exported
                    raise _closed_error()
                message = exported.message
                rc = lib.aib_pubtable_put(
                    self._table, raw_name, len(raw_name), message, len(message), fds, len(fds), keeper, err
                )
                if rc:
                    raise_for(rc, err, f"publishing {name!r}")
                self._names.add(name)
                self._current[name] = exported
                version = int(lib.aib_pubtable_version(self._table, raw_name, len(raw_name)))
                waiting = self._watch.published(raw_name, version)
        finally:
            lib.aib_owner_unref(keeper)  # the entry holds its own reference (or none: then it closes)
            try:
                reaper.drain()  # a replaced object without leases is closed now, not later
            finally:
                lib.aib_reaper_quiet(0)
        if waiting:  # sessions waiting for this name (or a newer version of it) get it now
            self._watch.deliver(waiting)
        return exported.stats

    def _renew(
        self, name: str, raw_name: bytes, current: Exported, obj: ArrowInput, copy: CopyPolicy
    ) -> ExportStats | None:
        """The in-place fast path of :meth:`publish`, when ``obj`` names exactly the memory of the
        current version (``exporter.record_in_place``, which re-records the shared event after the
        producer's new work): the entry keeps its message, fds and leases and gets a new version
        number. No placement, no encoding, no new entry; sessions' gets find the message they
        remember. None when ``obj`` is not such a version (nothing done)."""
        with self._lock:  # orders the check, the record and the renewal with other publishes
            if self._server.closed:
                raise _closed_error()
            if self._current.get(name) is not current or not record_in_place(current, obj, copy):
                return None
            waiting = self._renew_version_locked(raw_name)
        next(process_stats.in_place_publishes)
        if waiting:
            self._watch.deliver(waiting)
        return current.stats

    def _renew_version_locked(self, raw_name: bytes) -> list[HeldWait]:
        """A new version of the published entry ``raw_name`` (its message, fds and leases kept), and
        the held waits it answers (deliver them after the lock). Call under ``self._lock``."""
        version = int(lib.aib_pubtable_renew(self._table, raw_name, len(raw_name)))
        if version == 0:  # cannot happen: _current and the table change together under the lock
            raise NotPublishedError(f"nothing is published as {raw_name.decode(errors='replace')!r}")
        return self._watch.published(raw_name, version)

    def unpublish(self, name: str) -> None:
        """Stop serving ``name``; its data lives on until every lease on it has ended."""
        self._check_open()
        raw_name = protocol.encode_name(name)
        with self._lock:
            self._watch.unpublished(raw_name)
            absent = lib.aib_pubtable_remove(self._table, raw_name, len(raw_name))
            self._names.discard(name)
            self._current.pop(name, None)
        if absent:
            raise NotPublishedError(
                not_published_message(name, self._published_names(), every="Publisher.names()")
            )
        reaper.drain()

    def version(self, name: str) -> int:
        """The version ``name`` is published at now, 0 when it is not published.

        Every publish gets a new version, larger than every earlier one of this publisher (of any
        name, also across unpublish and republish); a new publisher starts again at 1 (its
        ``publisher_id`` differs). Sessions read it on objects got with ``wait=`` or
        ``get_next`` (``imported.version``).
        """
        self._check_open()
        raw_name = protocol.encode_name(name)
        return int(lib.aib_pubtable_version(self._table, raw_name, len(raw_name)))

    @property
    def held_waits(self) -> int:
        """Sessions' waits for a name or a newer version held open now (all connections together)."""
        return self._watch.held_waits

    def names(self) -> list[str]:
        """The names published now, sorted (live streams are listed by :meth:`stream_names`)."""
        self._check_open()
        with self._lock:
            return sorted(self._names)

    def _published_names(self) -> list[str]:
        """The names published now, unsorted: what an unknown name's error lists."""
        with self._lock:
            return list(self._names)

    @property
    def active_leases(self) -> int:
        """Leases currently held by sessions (all names together)."""
        return int(lib.aib_pubtable_leases(self._table))

    @property
    def active_sessions(self) -> int:
        """Connections open now, served or parked."""
        return self._server.active_connections()

    @property
    def serving_sessions(self) -> int:
        """Connections holding a thread now (the others are parked and cost none)."""
        return self._server.serving_connections()

    def _check_open(self) -> None:
        """Every method's first step: ClosedError (reason "forked") in a child of fork, then ClosedError."""
        self._check_process()
        if self._server.closed:
            raise _closed_error()

    def _check_process(self) -> None:
        if self._pid != process.pid:
            raise process.foreign("publisher", self._pid, "publish from a Publisher made here")

    # ---------- live streams (docs/streams.md) -------------------------------------------------------
    def open_stream(
        self,
        name: str,
        *,
        max_in_flight: int = 8,
        on_slow: str = "block",
        block_timeout: float | None = 10.0,
        slots: SlotLayout | None = None,
        copy: CopyPolicy | None = None,
    ) -> StreamWriter:
        """Open the live stream ``name`` and return its writer.

        Subscribers (``Session.subscribe``) get every batch written after they subscribed, in order.
        ``max_in_flight``: batches one consumer may hold unreleased (it may ask for fewer); ``on_slow``: what
        a write does when a consumer holds that many: ``"block"`` waits up to ``block_timeout`` seconds (None:
        forever) and then raises :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError`
        (``waiting_for="credit"``), sending nothing; ``"drop_oldest"`` queues up to ``max_in_flight`` more for
        that consumer and drops the oldest queued one past that; ``"error"`` ends that consumer's subscription
        with :class:`~arrow_ipc_bridge.errors.StreamError` (``reason="slow_consumer"``). ``slots``: reserve
        batch memory that ``StreamWriter.reserve`` hands out to fill in place. ``copy``: as for
        :meth:`publish`.
        """
        self._check_open()
        protocol.encode_name(name)
        max_in_flight = arguments.count(
            max_in_flight, "max_in_flight", least=1, most=stream_frames.MAX_IN_FLIGHT
        )
        arguments.choice(on_slow, "on_slow", stream_frames.POLICIES)
        block_timeout = arguments.optional_seconds(block_timeout, "block_timeout")
        if slots is not None and not isinstance(slots, SlotLayout):
            arguments.fail_type("slots", "a SlotLayout or None", slots)
        copy = self._copy if copy is None else copy_policy(copy)
        state = LiveStreamState(
            name, max_in_flight=max_in_flight, policy=on_slow, block_timeout=block_timeout
        )
        writer = StreamWriter(state, self._streams, copy=copy, slots=slots, check_open=self._check_open)
        self._streams.add(state)
        return writer

    def publish_stream(
        self, name: str, source: object, *, wait_for_subscribers: int = 0, **options: Any
    ) -> StreamWriter:
        """Open the live stream ``name`` and pump ``source`` into it on a background thread: any
        Arrow stream (``__arrow_c_stream__``, ``__arrow_c_device_stream__``) or iterable of arrays /
        record batches, read one batch at a time (an infinite generator runs until the stream is
        closed). The stream ends when the source does, or fails with the source's error.
        ``wait_for_subscribers``: start reading the source once that many consumers subscribed
        (subscribers get batches from the moment they join). ``options``: those of
        :meth:`open_stream`. Returns the writer (``close()`` stops the pump).
        """
        self._check_open()
        wait_for_subscribers = arguments.count(wait_for_subscribers, "wait_for_subscribers", least=0)
        check_source(source)
        writer = self.open_stream(name, **options)
        pump(writer, source, name=name, wait_for_subscribers=wait_for_subscribers)
        return writer

    def stream_names(self) -> list[str]:
        """Names of the live streams open now."""
        self._check_open()
        return self._streams.names()

    # ---------- serving one session -----------------------------------------------------------------
    def _serve(self, conn: transport.Connection) -> object:
        """Serve ``conn`` until it goes silent (then return ``transport.PARK``: the server calls this
        again, on a new thread, when it sends) or ends."""
        if not self._constructed.is_set():  # a connection accepted while __init__ still runs
            self._constructed.wait()
        state = self._served.get(conn)
        if state is None:
            channel = conn.channel
            served = lib.aib_server_conn_new(self._table, channel.raw)
            if served == ffi.NULL:
                raise MemoryError("allocating a connection's lease table")
            lib.aib_server_conn_configure(
                served, self._max_leases, self._max_unread_fds, millis(SEND_TIMEOUT)
            )
            state = self._served[conn] = _Served(channel, served)
        channel = state.channel
        raw_frame = ffi.new("aib_frame *")
        err = new_error()
        recv_lock, _ = channel.locked()
        while True:
            if state.welcomed:
                wait_ms = self._park_after_ms
            else:  # the handshake's deadline, set by the server at accept
                deadline = self._server.handshake_deadline(conn)
                wait_ms = -1 if deadline is None else millis(max(deadline - time.monotonic(), 0.0))
            # GET for published names, RELEASE and PING are answered in C; the rest comes back here.
            # The send lock is not held across the wait for a request: an answer to a held wait
            # goes out from the publishing thread meanwhile (the C loop's sends and its lease table
            # are ordered with it by the C connection's mutex; producer/watch.py).
            with recv_lock:
                conn.check_open()
                rc = lib.aib_serve(state.served, wait_ms, raw_frame, err)
                if rc == lib.AIB_E_PEER_CLOSED:
                    return None
                if rc == lib.AIB_SERVE_IDLE and state.welcomed:
                    return transport.PARK  # leases stay in the table meanwhile
                if rc not in _HANDLED_HERE:
                    raise channel.failed(rc, err, "serving a session", holding="recv")
                frame = None if rc == lib.AIB_SERVE_IDLE else frame_from(raw_frame)
            if frame is None:  # silent until the handshake's deadline
                timed_out = self._server.handshake_error()
                _log.warning("arrow_ipc_bridge: closing session pid %s: %s", conn.peer_pid, str(timed_out))
                with contextlib.suppress(BridgeError):  # the client may be gone or not reading
                    _farewell(conn, timed_out)
                return None
            if frame.kind == protocol.SUBSCRIBE and state.welcomed:
                # The connection is the subscription's from now on; it ends with it.
                self._streams.serve_subscription(channel, frame.payload, conn.peer_pid)
                return None
            try:
                if rc in _LIMITS:
                    raise self._limit_error(rc, frame.payload)
                self._answer(state, frame)
                if frame.kind == protocol.HELLO:
                    self._server.established(conn)
            except (NotPublishedError, RegionError, LimitError) as exc:  # the session may go on
                channel.send(protocol.ERROR, protocol.encode_error(exc), timeout=SEND_TIMEOUT)
            except ProtocolError as exc:
                _log.warning("arrow_ipc_bridge: closing session pid %s: %s", conn.peer_pid, str(exc))
                channel.send(protocol.ERROR, protocol.encode_error(exc), timeout=SEND_TIMEOUT)
                return None

    def _limit_error(self, rc: int, raw_name: bytes) -> LimitError:
        """The error for a GET the C loop refused at a limit (nothing was leased or sent)."""
        name = raw_name.decode("utf-8", "replace")
        if rc == lib.AIB_SERVE_LEASE_LIMIT:
            return LimitError(
                f"GET {name!r} refused: this connection holds {self._max_leases} leases "
                "(the publisher's max_leases_per_connection); release some and get again",
                limit="max_leases_per_connection",
                value=self._max_leases,
            )
        if rc == lib.AIB_SERVE_UNREAD_LIMIT:
            return LimitError(
                f"GET {name!r} refused: this connection has not read answers carrying descriptors "
                f"(the publisher's max_unread_fds is {self._max_unread_fds}); read the answers first",
                limit="max_unread_fds",
                value=self._max_unread_fds,
            )
        return LimitError(
            f"GET {name!r} failed: the kernel refused to pass its descriptors (ETOOMANYREFS: too "
            "many in flight to peers that do not read); nothing was leased, retry",
            limit="descriptors_in_flight",
        )

    def _message_bytes(self, raw_name: bytes) -> int:
        """The size of the message published as ``raw_name`` now (0: none), what an answer to a
        held wait carries (producer/watch.py: the publishing thread sends only small answers itself)."""
        exported = self._current.get(raw_name.decode("utf-8", "replace"))
        return 0 if exported is None else len(exported.message)

    def _holds_nothing(self, conn: transport.Connection) -> bool:
        """Whether the parked ``conn`` holds no lease and no held wait (the server's ``evictable``:
        it closes the connection next to make room). No handler runs for a parked connection, so
        no wait can be held after this look; a lease neither once the C table retired it."""
        state = self._served.get(conn)
        if state is None:  # never served: nothing of it here
            return True
        return state.waiting.waits == 0 and bool(lib.aib_server_conn_retire(state.served))

    def _forget_connection(self, conn: transport.Connection) -> None:
        """The server closed ``conn`` for good: give its leases back (the server's on_close)."""
        state = self._served.pop(conn, None)
        if state is None:
            return
        self._watch.forget(state.waiting)  # no answer to a held wait uses the lease table after this
        lib.aib_server_conn_free(state.served)  # gives this session's leases back
        reaper.drain()

    def _answer(self, state: _Served, frame: Frame) -> None:
        """The frames the C loop leaves to Python: handshake, LIST, POOL_FD, unknown names, bad frames."""
        channel = state.channel
        if frame.kind == protocol.HELLO:
            if state.welcomed:
                raise ProtocolError("a second HELLO")
            version = protocol.decode_hello(frame.payload)
            if version != protocol.PROTOCOL_VERSION:
                raise ProtocolError(
                    f"session speaks protocol {version}, this publisher {protocol.PROTOCOL_VERSION}"
                )
            channel.send(protocol.WELCOME, protocol.encode_json(self._welcome()), timeout=SEND_TIMEOUT)
            state.welcomed = True
            lib.aib_server_conn_welcome(state.served)  # from now on the C loop answers requests
        elif not state.welcomed:
            raise ProtocolError(f"frame kind {frame.kind} before HELLO (say HELLO first)")
        elif frame.kind == protocol.LIST:
            channel.send(protocol.NAMES, protocol.encode_json(self.names()), timeout=SEND_TIMEOUT)
        elif frame.kind == protocol.WAIT:
            after, timeout_ms, name = protocol.decode_wait(frame.payload)  # ProtocolError when malformed
            self._watch.request(HeldWait(state.waiting, name.encode(), after, timeout_ms))
        elif frame.kind == protocol.POOL_FD:
            self._send_pool_fd(channel, protocol.decode_pool_identity(frame.payload))
        elif frame.kind == protocol.BOARD_FD:
            if self._board is None or frame.payload:
                raise ProtocolError("BOARD_FD to a publisher without a board, or with a payload")
            channel.send(
                protocol.BOARD, encode_board(self._board.n_slots), [self._board.fd], timeout=SEND_TIMEOUT
            )
            # From its next GET on, the session is answered with the entry's board slot and serial.
            lib.aib_server_conn_use_board(state.served)
        elif frame.kind == protocol.GET:
            name = protocol.decode_name(frame.payload)  # ProtocolError for a malformed name
            published = self._published_names()
            raise NotPublishedError(not_published_message(name, published, self._streams.names()))
        elif frame.kind == protocol.RELEASE:
            protocol.decode_lease(frame.payload)  # the C loop takes every well-formed RELEASE
            raise ProtocolError("malformed RELEASE frame")
        elif frame.kind == protocol.PING:  # the C loop answers every PING up to MAX_PING bytes
            raise ProtocolError(f"PING payload of {len(frame.payload)} bytes (at most {protocol.MAX_PING})")
        else:
            raise ProtocolError(f"unexpected frame kind {frame.kind}")

    @staticmethod
    def _send_pool_fd(channel: Channel, identity: bytes) -> None:
        """Answer POOL_FD: the fd of one of our IPC pools that an exported message named. Messages
        leave pool fds out (see publish), so each session process asks once per pool."""
        from arrow_ipc_bridge.cuda import placer as cuda_regions  # loads no CUDA until a pool is named

        fd = cuda_regions.pool_fd_for(identity)  # NotPublishedError for a pool not (or no longer) here
        try:
            channel.send(protocol.POOL, identity, [fd], timeout=SEND_TIMEOUT)
        finally:
            os.close(fd)

    def _welcome(self) -> dict[str, Any]:
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "wire": list(WIRE_VERSION),
            "publisher_id": self.publisher_id,
            "pid": os.getpid(),
            "features": [
                f for f in protocol.FEATURES if f not in protocol.BOARD_FEATURES or self._board is not None
            ],
        }

    # ---------- lifetime ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._server.closed

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving (idempotent). Sessions are disconnected; what they already mapped stays valid.

        In a child of ``fork`` this only drops the child's copies of the descriptors: the socket
        file, the sessions and the published data stay the parent's."""
        timeout = arguments.seconds(timeout, "timeout")
        if self._pid == process.pid:
            self._streams.close("the publisher closed while the stream was open")
            self._watch.close()  # every held wait is answered: the publisher is closing
        self._server.close(timeout)  # every connection's on_close gave its leases back
        if self._pid != process.pid:
            return
        self._watch.join_answerer(timeout)  # its connections are closed: it has nothing left to wait for
        with self._lock:
            self._watch.cleared()
            lib.aib_pubtable_clear(self._table)
            lib.aib_pubtable_set_board(self._table, ffi.NULL, 0)  # no more writes: the page may go
            self._names.clear()
            self._current.clear()
            if self._board is not None:
                self._board.close()
        reaper.drain()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# The C loop's returns for a GET it refused at a limit (the frame is the GET), and all it returns
# that are not errors.
_LIMITS = frozenset({lib.AIB_SERVE_LEASE_LIMIT, lib.AIB_SERVE_UNREAD_LIMIT, lib.AIB_SERVE_FDS_BUSY})
_HANDLED_HERE = _LIMITS | {lib.AIB_SERVE_IDLE, lib.AIB_SERVE_FRAME}


def _closed_error() -> ClosedError:
    return ClosedError("this publisher is closed: make a new Publisher", what="publisher")


def _uids(allowed_uids: object) -> list[int] | None:
    """``allowed_uids`` checked: None or an iterable of uids (ints >= 0), not a string."""
    if allowed_uids is None:
        return None
    if isinstance(allowed_uids, str | bytes) or not isinstance(allowed_uids, Iterable):
        arguments.fail_type("allowed_uids", "an iterable of uids (ints >= 0) or None", allowed_uids)
    return [arguments.count(uid, "allowed_uids", least=0) for uid in allowed_uids]


def _farewell(conn: transport.Connection, error: BridgeError) -> None:
    """Tell a client the server refuses or drops why, as an ERROR frame (the server's farewell). A
    fresh socket's buffer is empty, so this never waits; a client gone already is ignored."""
    conn.channel.send(protocol.ERROR, protocol.encode_error(error), timeout=0)
