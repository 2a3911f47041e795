"""The accept side: a Unix socket server that admits, parks and serves connections on threads.

What is not framing lives here: uid admission by ``SO_PEERCRED`` (``allowed_uids``), the
``max_connections`` limit and its fairness (caps per process and per uid, idle connections closed
to make room), the handshake deadline, the parking lot of idle connections (watched by the accept
thread's selector instead of a thread each) and the farewell a refused client gets. The socket file
itself is :mod:`~arrow_ipc_bridge.transport.socket_path`'s.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Final

from arrow_ipc_bridge.errors import (
    BridgeError,
    BridgeTimeoutError,
    LimitError,
    PeerClosedError,
    TransportError,
)
from arrow_ipc_bridge.runtime import process
from arrow_ipc_bridge.transport.channel import MAX_PAYLOAD
from arrow_ipc_bridge.transport.connection import Connection, check_max_payload
from arrow_ipc_bridge.transport.socket_path import (
    SOCKET_MODE_OWNER,
    SOCKET_MODE_SHARED,
    bind_listening,
    unlink_if_ours,
)

__all__ = ["PARK", "Server"]

logger = logging.getLogger(__name__)

_ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _refused_frame(
    conn: weakref.ref[Connection], farewell: Callable[[Connection, BridgeError], object], error: BridgeError
) -> None:
    """A channel's farewell (:attr:`Channel.farewell <arrow_ipc_bridge.transport.channel.Channel.farewell>`):
    the server's, for the connection whose frame was refused."""
    alive = conn()
    if alive is not None:
        farewell(alive, error)


class _Park:
    """The type of :data:`PARK`."""

    def __repr__(self) -> str:
        return "PARK"


PARK: Final = _Park()
"""What a :class:`Server` handler returns to give its thread back while keeping its connection
(``park=True``): the connection waits in the parking lot, and the handler is called again, on a new
thread, when the connection has something to read."""


@dataclass(slots=True, eq=False)
class _Slot:
    """What the server knows of one admitted connection."""

    thread: threading.Thread | None = None  # None while parked
    deadline: float | None = None  # handshake deadline (time.monotonic()), None once established
    parked_at: float = 0.0  # when it last went to the parking lot (time.monotonic())
    finishing: bool = False  # being finished (on_close running): close() waits for its thread


class Server:
    """Accept connections on a Unix socket and serve them on threads.

    The socket file is created with mode 0600, or 0666 when uids other than this process's are
    allowed (connecting needs write permission on the file); either way only peers whose
    ``SO_PEERCRED`` uid is allowed are served: others get the ``farewell`` and are disconnected at
    once, counted in :attr:`rejected_connections`. Each accepted connection runs ``handler(conn)`` on a
    daemon thread; when the handler returns (anything but :data:`PARK`) or raises, the connection is
    closed. A handler that raises closes only its own connection, never the server:
    :class:`~arrow_ipc_bridge.errors.PeerClosedError` is logged at debug level, other
    :class:`~arrow_ipc_bridge.errors.BridgeError` and ``OSError`` at warning level, anything else with its
    traceback at error level.

    With ``park=True`` a connection costs a thread only while it has work: a new connection waits in
    the *parking lot* (the accept thread's selector) until it is readable, and a handler that returns
    :data:`PARK` gives its thread back and is called again, on a new thread, when the connection is
    readable again. Threads are then the connections being served plus one.

    Parameters
    ----------
    path:
        Where to create the socket file. A stale socket file (nobody accepts on it) is replaced; a path
        where a server is listening, or that is not a socket, is refused. Only filesystem paths are
        supported (no abstract namespace), and ``AF_UNIX`` limits them to about 107 bytes.
    handler:
        Called with each accepted :class:`Connection`, on a thread of its own.
    allowed_uids:
        Uids allowed to connect, in addition to this process's uid (see ``include_owner``).
    include_owner:
        When true (the default) this process's own uid is always allowed. Pass ``False`` to make
        ``allowed_uids`` the complete list (an empty list then rejects everybody).
    backlog:
        Length of the kernel's queue of connections not yet accepted.
    max_payload:
        Payload limit, in bytes, of every accepted connection.
    name:
        Prefix of the server's thread names, and its name in log messages.
    max_connections:
        Most connections served at once (``None``: no limit). When they are all taken, a new
        connection first makes room by closing an idle one (below); when none can go it gets the
        ``farewell`` with :class:`~arrow_ipc_bridge.errors.LimitError` and is closed.
    max_connections_per_process:
        Most connections one process (the peer's ``SO_PEERCRED`` pid) may hold at once (``None``:
        no limit); one more gets the ``farewell`` with LimitError and is closed.
    max_connections_per_uid:
        Most connections the processes of one uid other than this process's may hold at once
        (``None``: no limit); one more gets the ``farewell`` with LimitError. The
        server's own uid is not capped: its processes have every power over the server anyway, and
        they are its usual clients (the per-process cap bounds each of them).
    evictable:
        With ``park=True``: called on the accept thread with a parked connection that completed
        its handshake, which the server would close to make room for a new connection once
        ``max_connections`` are taken. Return true when closing it takes nothing its client relies
        on (and see that it gets nothing more: it is closed next), false to keep it. ``None``: only
        connections that have not completed their handshake are closed to make room. The server
        picks among the parked connections of the process holding the most connections, if that
        process holds at least two more than the new connection's process; the one parked longest
        first. The closed connection gets the ``farewell`` with LimitError.
    handshake_timeout:
        Seconds a connection has from its accept until the handler calls :meth:`established` (``None``: no
        limit). A parked connection past it gets the ``farewell`` with
        :class:`~arrow_ipc_bridge.errors.BridgeTimeoutError` (``waiting_for="handshake"``) and is closed; a
        handler running meanwhile reads the deadline with :meth:`handshake_deadline` and enforces it itself.
    park:
        Give threads only to connections with something to read (above).
    farewell:
        Called with a connection the server refuses or drops (uid not allowed, over
        ``max_connections``, handshake timeout), or whose channel refused a frame that broke the
        framing (a :class:`~arrow_ipc_bridge.errors.ProtocolError`: a bad header, a payload over
        the limit the channel was given for its kind), and the error that says why, just before it
        is closed: the place to tell the client in the protocol's words. It must not block.
    on_close:
        Called once for every admitted connection, after it was closed and while no handler runs for
        it: the place to free what the handler kept for it between calls.

    Raises
    ------
    TransportError
        The path is held by a live server or by something that is not a socket, or binding failed (no such
        directory, permission denied, path too long).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        handler: Callable[[Connection], object],
        *,
        allowed_uids: Iterable[int] | None = None,
        include_owner: bool = True,
        backlog: int = 128,
        max_payload: int = MAX_PAYLOAD,
        name: str = "aib-server",
        max_connections: int | None = None,
        handshake_timeout: float | None = None,
        park: bool = False,
        farewell: Callable[[Connection, BridgeError], object] | None = None,
        on_close: Callable[[Connection], object] | None = None,
        max_connections_per_process: int | None = None,
        max_connections_per_uid: int | None = None,
        evictable: Callable[[Connection], bool] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.name = name
        self._handler = handler
        self._max_payload = check_max_payload(max_payload)
        uids = {int(uid) for uid in allowed_uids} if allowed_uids is not None else set()
        if include_owner:
            uids.add(os.getuid())
        self._allowed_uids = frozenset(uids)
        for what, limit in (
            ("max_connections", max_connections),
            ("max_connections_per_process", max_connections_per_process),
            ("max_connections_per_uid", max_connections_per_uid),
        ):
            if limit is not None and limit < 1:
                raise ValueError(f"{what} must be >= 1 or None, not {limit!r}")
        if handshake_timeout is not None and not handshake_timeout > 0:
            raise ValueError(f"handshake_timeout must be > 0 seconds or None, not {handshake_timeout!r}")
        self._max_connections = max_connections
        self._max_per_process = max_connections_per_process
        self._max_per_uid = max_connections_per_uid
        self._evictable = evictable
        self._handshake_timeout = handshake_timeout
        self._park = park
        self._farewell = farewell
        self._on_close = on_close

        self._lock = threading.Lock()
        self._closing = False
        self._pid = process.pid
        self._stop = threading.Event()
        self._conns: dict[Connection, _Slot] = {}
        # Admitted connections by peer process and by peer uid (under _lock), for the caps and for
        # choosing whom an idle connection is taken from.
        self._per_pid: dict[int, int] = {}
        self._per_uid: dict[int, int] = {}
        self._to_park: list[Connection] = []  # handed back by handlers; registered by the accept thread
        # Registered in the selector, with the descriptor they were registered under (accept thread
        # only): unregistering by that number works even if the connection was closed meanwhile.
        self._parked: dict[Connection, int] = {}
        # Parked connections that have not completed their handshake -> its deadline (accept thread
        # only): what the selector's timeout is computed from, without a look at every parked one.
        self._handshaking: dict[Connection, float] = {}
        self._rejected = 0
        self._over_limit = 0
        self._timed_out = 0
        self._evicted = 0
        self._accepted = 0

        # The accept loop waits on the listening socket, the parked connections and this pipe; a
        # handler parking a connection or close() writes to the pipe to wake it.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        selector: selectors.BaseSelector | None = None
        sock: socket.socket | None = None
        try:
            self._selector = selector = selectors.DefaultSelector()
            sock, self._ident = bind_listening(self.path, self.socket_mode, backlog, name)
            self._sock = sock
            selector.register(sock, selectors.EVENT_READ, "accept")
            selector.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._accept_thread = threading.Thread(
                target=self._accept_loop, name=f"{name}-accept", daemon=True
            )
            self._accept_thread.start()
        except BaseException:
            if sock is not None:
                unlink_if_ours(self.path, self._ident)
                sock.close()
            if selector is not None:
                selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    # -- public ----------------------------------------------------------------------------------------

    @property
    def rejected_connections(self) -> int:
        """How many connections were refused because of their uid."""
        return self._rejected

    @property
    def refused_over_limit(self) -> int:
        """How many connections were refused at a connection limit (``max_connections`` with none
        idle to close, or their process's or uid's cap)."""
        return self._over_limit

    @property
    def evicted_connections(self) -> int:
        """How many idle connections were closed to make room for new ones (``max_connections``)."""
        return self._evicted

    @property
    def handshake_timeouts(self) -> int:
        """How many connections were closed because their handshake took too long."""
        return self._timed_out

    @property
    def allowed_uids(self) -> frozenset[int]:
        """The uids this server serves."""
        return self._allowed_uids

    @property
    def socket_mode(self) -> int:
        """The socket file's permission bits: 0o600, or 0o666 when other uids are allowed."""
        return SOCKET_MODE_SHARED if self._allowed_uids - {os.getuid()} else SOCKET_MODE_OWNER

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closing

    def active_connections(self) -> int:
        """How many accepted connections are open right now (served or parked)."""
        with self._lock:
            return len(self._conns)

    def serving_connections(self) -> int:
        """How many connections hold a thread right now (not parked)."""
        with self._lock:
            return sum(slot.thread is not None for slot in self._conns.values())

    def established(self, conn: Connection) -> None:
        """The handler completed ``conn``'s handshake: no handshake deadline applies any more."""
        with self._lock:
            slot = self._conns.get(conn)
            if slot is not None:
                slot.deadline = None

    def handshake_deadline(self, conn: Connection) -> float | None:
        """When ``conn``'s handshake must be complete (``time.monotonic()``), or ``None``."""
        with self._lock:
            slot = self._conns.get(conn)
            return None if slot is None else slot.deadline

    def __repr__(self) -> str:
        state = "closed" if self._closing else "listening"
        return f"<Server {self.name!r} {state} on {self.path!r}>"

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the server; idempotent.

        Stops accepting, removes the socket file (only if it is still the one this server created),
        closes every live connection (which wakes handlers blocked in ``recv``/``send`` with
        :class:`~arrow_ipc_bridge.errors.PeerClosedError`) and waits for the server's threads.

        Parameters
        ----------
        timeout:
            Seconds to wait for the threads in all. A handler still running after that (stuck outside the
            connection's calls) is logged and left behind; its thread is a daemon.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        if self._pid != process.pid:
            # A fork child's copy: the socket file, the threads and the connections are the
            # parent's (and its locks may have been held at the fork). Only our descriptors go.
            self._closing = True
            self._sock.close()
            with contextlib.suppress(OSError):
                self._selector.close()
                os.close(self._wake_r)
                os.close(self._wake_w)
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop.set()
        self._wake()
        me = threading.current_thread()
        if self._accept_thread is not me:
            self._accept_thread.join(max(deadline - time.monotonic(), 0.0))
        unlink_if_ours(self.path, self._ident)
        self._sock.close()
        if self._accept_thread.is_alive():
            logger.warning("%r: the accept thread did not stop within %s s", self, timeout)
        else:
            # Only once the accept thread is gone: closing descriptors it may still be polling would let
            # their numbers be reused under it.
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

        with self._lock:
            live = [(conn, slot.thread) for conn, slot in self._conns.items()]
        for conn, thread in live:
            if thread is None:  # parked: no handler will finish it
                self._finish(conn)
            else:
                conn.close()
        for _, thread in live:
            if thread is not None and thread is not me:
                thread.join(max(deadline - time.monotonic(), 0.0))
        stuck = [
            thread.name for _, thread in live if thread is not None and thread.is_alive() and thread is not me
        ]
        if stuck:
            logger.warning("%r: handler threads still running after %s s: %s", self, timeout, stuck)

    def _wake(self) -> None:
        # Fails only when the pipe is full, and then the accept loop is being woken already.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- accepting, parking and serving ------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._selector.select(self._next_timeout())
            except OSError:
                if self._stop.is_set():
                    return
                raise
            for key, _ in events:
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    if self._stop.is_set():
                        return
                elif key.data == "accept":
                    self._accept_all()
                else:
                    self._unpark(key.data)
            self._park_handed_back()
            self._expire_handshakes()

    def _accept_all(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._stop.is_set():
                    return
                if exc.errno in _ACCEPT_RESOURCE_ERRNOS:
                    # The pending connection stays queued and the socket stays readable: back off
                    # instead of spinning until descriptors or memory free up.
                    logger.warning("%r: accept failed (%s); retrying in 0.1 s", self, exc)
                    self._stop.wait(0.1)
                else:
                    logger.warning("%r: accept failed: %s", self, exc)
                return
            self._admit(sock)

    def _refuse(self, conn: Connection, error: BridgeError) -> None:
        """Tell a refused client why (the farewell), then close its connection."""
        if self._farewell is not None:
            try:
                self._farewell(conn, error)
            except Exception as exc:  # the client may be gone already; it is closed either way
                logger.debug("%r: farewell to pid %d failed: %s", self, conn.peer_pid, exc)
        conn.close()

    def _admit(self, sock: socket.socket) -> None:
        try:
            conn = Connection(sock, max_payload=self._max_payload)
        except BridgeError as exc:
            logger.debug("%r: dropped a connection that went away before it was served: %s", self, exc)
            sock.close()
            return
        if conn.peer_uid not in self._allowed_uids:
            with self._lock:
                self._rejected += 1
            logger.warning(
                "%r: rejected a connection from pid %d with uid %d (allowed uids: %s)",
                self,
                conn.peer_pid,
                conn.peer_uid,
                sorted(self._allowed_uids),
            )
            self._refuse(
                conn,
                TransportError(
                    f"uid {conn.peer_uid} is not allowed to connect (the publisher's allowed_uids)",
                    reason="rejected",
                    uid=conn.peer_uid,
                ),
            )
            return
        if self._farewell is not None:
            # A frame that breaks the framing (one over its kind's limit, read from the header alone)
            # is refused in the channel: the client hears why before it is closed. Weakly: the
            # channel must not keep its connection alive.
            conn.channel.farewell = functools.partial(_refused_frame, weakref.ref(conn), self._farewell)
        refusal = self._over_peer_cap(conn)
        if refusal is None and self._full():
            victim = self._idle_victim(conn)
            if victim is None:
                refusal = LimitError(
                    f"the publisher serves its maximum of {self._max_connections} connections "
                    "(max_connections) and none is idle to close for this one: close unused sessions "
                    "or retry later",
                    limit="max_connections",
                    value=self._max_connections,
                )
            else:
                self._evict(victim)
        now = time.monotonic()
        deadline = None if self._handshake_timeout is None else now + self._handshake_timeout
        with self._lock:
            closing = self._closing
            if refusal is not None:
                self._over_limit += 1
            elif not closing:
                self._accepted += 1
                self._conns[conn] = _Slot(deadline=deadline, parked_at=now)
                self._per_pid[conn.peer_pid] = self._per_pid.get(conn.peer_pid, 0) + 1
                self._per_uid[conn.peer_uid] = self._per_uid.get(conn.peer_uid, 0) + 1
        if closing:
            conn.close()
        elif refusal is not None:
            logger.warning("%r: refused a connection from pid %d: %s", self, conn.peer_pid, refusal.message)
            self._refuse(conn, refusal)
        elif self._park:
            self._park_now(conn)  # a thread once it has something to say
        else:
            self._unpark(conn)

    def _full(self) -> bool:
        with self._lock:
            return self._max_connections is not None and len(self._conns) >= self._max_connections

    def _over_peer_cap(self, conn: Connection) -> LimitError | None:
        """The error for a connection whose process or uid holds its cap of connections already."""
        with self._lock:
            by_process = self._per_pid.get(conn.peer_pid, 0)
            by_uid = self._per_uid.get(conn.peer_uid, 0)
        if self._max_per_process is not None and by_process >= self._max_per_process:
            return LimitError(
                f"process {conn.peer_pid} holds {by_process} connections to the publisher, its "
                f"max_connections_per_process: close unused sessions (each session and each "
                "subscription is one) or retry later",
                limit="max_connections_per_process",
                value=self._max_per_process,
            )
        if self._max_per_uid is not None and conn.peer_uid != os.getuid() and by_uid >= self._max_per_uid:
            return LimitError(
                f"uid {conn.peer_uid} holds {by_uid} connections to the publisher, its "
                "max_connections_per_uid: close unused sessions or retry later",
                limit="max_connections_per_uid",
                value=self._max_per_uid,
            )
        return None

    def _idle_victim(self, newcomer: Connection) -> Connection | None:
        """A parked connection to close so that ``newcomer`` gets its slot (accept thread only): one
        of the process holding the most connections, if it holds at least two more than the
        newcomer's process (after the swap it still holds at least as many), the one parked
        longest first; one that has not completed its handshake, or that ``evictable`` lets go."""
        with self._lock:
            newcomers = self._per_pid.get(newcomer.peer_pid, 0)
            candidates = []
            for conn in self._parked:
                slot = self._conns.get(conn)
                held = self._per_pid.get(conn.peer_pid, 0)
                if slot is not None and slot.thread is None and held > newcomers + 1:
                    candidates.append((-held, slot.parked_at, slot.deadline is not None, conn))
        candidates.sort(key=lambda candidate: candidate[:2])
        for _, _, handshaking, conn in candidates:
            if handshaking:
                return conn
            if self._evictable is not None:
                try:
                    if self._evictable(conn):
                        return conn
                except Exception:
                    logger.exception("%r: evictable for pid %d raised", self, conn.peer_pid)
        return None

    def _evict(self, conn: Connection) -> None:
        """Close an idle parked connection to make room (accept thread only), telling its client."""
        self._unwatch(conn)
        with self._lock:
            self._evicted += 1
            held = self._per_pid.get(conn.peer_pid, 0)
        logger.warning(
            "%r: closing an idle connection of pid %d (which holds %d) to make room (max_connections)",
            self,
            conn.peer_pid,
            held,
        )
        self._refuse(
            conn,
            LimitError(
                f"this connection was idle and was closed to make room for another client: the "
                f"publisher serves its maximum of {self._max_connections} connections "
                f"(max_connections) and process {conn.peer_pid} held {held} of them; connect again "
                "when needed",
                limit="max_connections",
                value=self._max_connections,
            ),
        )
        self._finish(conn)

    def _park_now(self, conn: Connection) -> None:
        """Watch a connection without a thread (accept thread only)."""
        fd = conn.fileno()
        try:
            self._selector.register(fd, selectors.EVENT_READ, conn)
        except (KeyError, ValueError, OSError):  # closed meanwhile
            self._finish(conn)
            return
        self._parked[conn] = fd
        with self._lock:
            slot = self._conns.get(conn)
            deadline = None if slot is None else slot.deadline
            if slot is not None:
                slot.parked_at = time.monotonic()
        if deadline is not None:
            self._handshaking[conn] = deadline

    def _unwatch(self, conn: Connection) -> None:
        """Take a connection out of the parking lot, if it is there (accept thread only)."""
        fd = self._parked.pop(conn, None)
        self._handshaking.pop(conn, None)
        if fd is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(fd)

    def _park_handed_back(self) -> None:
        with self._lock:
            handed_back, self._to_park = self._to_park, []
        for conn in handed_back:
            self._park_now(conn)

    def _unpark(self, conn: Connection) -> None:
        """Give a connection a thread that runs the handler (accept thread only)."""
        self._unwatch(conn)
        with self._lock:
            slot = self._conns.get(conn)
            if slot is None or self._closing:
                return
            thread = threading.Thread(
                target=self._run,
                args=(conn,),
                name=f"{self.name}-fd{conn.fileno()}-pid{conn.peer_pid}",
                daemon=True,
            )
            slot.thread = thread
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            logger.warning("%r: cannot start a handler thread, dropping the connection: %s", self, exc)
            self._finish(conn)

    def _next_timeout(self) -> float | None:
        """Seconds until the first parked connection's handshake deadline (None: no deadline)."""
        if not self._handshaking:
            return None
        return max(min(self._handshaking.values()) - time.monotonic(), 0.0)

    def _expire_handshakes(self) -> None:
        if not self._handshaking:
            return
        now = time.monotonic()
        late = [conn for conn, deadline in self._handshaking.items() if deadline <= now]
        for conn in late:
            self._unwatch(conn)
            with self._lock:
                self._timed_out += 1
            logger.warning(
                "%r: closing a connection from pid %d: no handshake within %s s",
                self,
                conn.peer_pid,
                self._handshake_timeout,
            )
            self._refuse(conn, self.handshake_error())
            self._finish(conn)

    def handshake_error(self) -> BridgeTimeoutError:
        """The error a connection that did not complete its handshake in time is closed with."""
        return BridgeTimeoutError(
            f"no handshake within the publisher's handshake_timeout of {self._handshake_timeout} s",
            waiting_for="handshake",
            timeout=self._handshake_timeout,
        )

    def _run(self, conn: Connection) -> None:
        result: object = None
        try:
            result = self._handler(conn)
        except PeerClosedError as exc:
            logger.debug("%r: connection from pid %d ended: %s", self, conn.peer_pid, exc)
        except (BridgeError, OSError) as exc:
            # The text, not the exception: a handler that keeps log records would keep the exception's
            # traceback, and with it the serving frames and whatever they hold (a peer's descriptors).
            logger.warning(
                "%r: handler for pid %d failed, closing that connection: %s: %s",
                self,
                conn.peer_pid,
                exc.__class__.__name__,
                str(exc),
            )
        except Exception:
            logger.exception("%r: handler for pid %d raised, closing that connection", self, conn.peer_pid)
        if result is PARK and self._park:
            with self._lock:
                slot = self._conns.get(conn)
                parked = slot is not None and not self._closing and not conn.closed
                if parked and slot is not None:
                    slot.thread = None
                    self._to_park.append(conn)
            if parked:
                self._wake()
                return
        self._finish(conn)

    def _finish(self, conn: Connection) -> None:
        """Close an admitted connection for good and tell ``on_close`` (once). The connection stays
        among the server's until ``on_close`` returned, so that :meth:`close` waits for the thread
        finishing it (a publisher's close() then never returns with its leases still counted)."""
        conn.close()
        with self._lock:
            slot = self._conns.get(conn)
            if slot is None or slot.finishing:
                return
            slot.finishing = True
        try:
            if self._on_close is not None:
                try:
                    self._on_close(conn)
                except Exception:
                    logger.exception("%r: on_close for pid %d raised", self, conn.peer_pid)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                for counts, key in ((self._per_pid, conn.peer_pid), (self._per_uid, conn.peer_uid)):
                    left = counts[key] - 1
                    if left:
                        counts[key] = left
                    else:
                        del counts[key]
