"""Producer side server: publish named Arrow objects, serve them to sessions under leases.

Each published name holds an :class:`~arrow_ipc_bridge.exporter.Exported` (captured data, its region
fds and the encoded message, made once at publish time, so a ``get`` costs one frame). Every ``get``
takes a lease on that entry; the entry, and with it the producer's buffers, lives until it is
unpublished *and* every lease on it ended. A session that disconnects or dies gives back all its
leases at once (the connection's handler sees the socket close).
"""

from __future__ import annotations

import logging
import os
import threading
from types import TracebackType
from typing import Any

from arrow_ipc_bridge import protocol, transport
from arrow_ipc_bridge._ffi import WIRE_VERSION
from arrow_ipc_bridge.errors import BridgeError, NotPublishedError, PeerClosedError, ProtocolError
from arrow_ipc_bridge.exporter import CopyPolicy, Exported, ExportStats, export

__all__ = ["Publisher"]

_log = logging.getLogger("arrow_ipc_bridge")


class _Entry:
    """One published object and the count of holds on it (1 while published, +1 per lease)."""

    def __init__(self, name: str, exported: Exported) -> None:
        self.name = name
        self.exported = exported
        self.holds = 1


class Publisher:
    """Serve Arrow objects by name over a Unix socket, on a background thread.

    Parameters
    ----------
    path
        Socket file to create (mode 0600). A stale one is replaced; a live publisher's is refused.
    allowed_uids
        Extra uids allowed to connect (this process's uid always is).
    copy
        Default copy policy for :meth:`publish` (see :func:`~arrow_ipc_bridge.export`).

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
    ) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._leases = 0
        self._copy: CopyPolicy = copy
        self.publisher_id = os.urandom(16).hex()
        self._server = transport.Server(path, self._serve, allowed_uids=allowed_uids, name="aib-publisher")
        self.path = self._server.path

    # ---------- publishing --------------------------------------------------------------------------
    def publish(self, name: str, obj: object, *, copy: CopyPolicy | None = None) -> ExportStats:
        """Publish ``obj`` as ``name`` (replacing an earlier object of that name).

        Sessions holding leases on the replaced object keep it until they release it. Returns what
        the export cost (regions, bytes copied).
        """
        protocol.encode_name(name)  # validates the name
        self._check_open()
        exported = export(obj, copy=copy or self._copy)
        with self._lock:
            if self._server.closed:  # closed while we exported
                exported.close()
                raise BridgeError("this publisher is closed")
            previous = self._entries.get(name)
            self._entries[name] = _Entry(name, exported)
        if previous is not None:
            self._drop(previous)
        return exported.stats

    def unpublish(self, name: str) -> None:
        """Stop serving ``name``; its data lives on until every lease on it has ended."""
        with self._lock:
            entry = self._entries.pop(name, None)
        if entry is None:
            raise NotPublishedError(f"nothing is published as {name!r}")
        self._drop(entry)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    @property
    def active_leases(self) -> int:
        """Leases currently held by sessions (all names together)."""
        with self._lock:
            return self._leases

    @property
    def active_sessions(self) -> int:
        return self._server.active_connections()

    def _drop(self, entry: _Entry) -> None:
        with self._lock:
            entry.holds -= 1
            last = entry.holds == 0
        if last:
            entry.exported.close()

    def _check_open(self) -> None:
        if self._server.closed:
            raise BridgeError("this publisher is closed")

    # ---------- serving one session -----------------------------------------------------------------
    def _serve(self, conn: transport.Connection) -> None:
        leases: dict[int, _Entry] = {}
        next_lease = 1
        try:
            while True:
                try:
                    frame = conn.recv()
                except PeerClosedError:
                    return
                frame.close_fds()  # sessions never send descriptors
                try:
                    if frame.kind == protocol.HELLO:
                        version = protocol.decode_hello(frame.payload)
                        if version != protocol.PROTOCOL_VERSION:
                            raise ProtocolError(
                                f"session speaks protocol {version}, "
                                f"this publisher {protocol.PROTOCOL_VERSION}"
                            )
                        conn.send(protocol.WELCOME, protocol.encode_json(self._welcome()))
                    elif frame.kind == protocol.LIST:
                        conn.send(protocol.NAMES, protocol.encode_json(self.names()))
                    elif frame.kind == protocol.GET:
                        name = protocol.decode_name(frame.payload)
                        entry = self._take(name)
                        lease_id = next_lease
                        next_lease += 1
                        leases[lease_id] = entry
                        conn.send(
                            protocol.ITEM,
                            protocol.encode_item(lease_id, entry.exported.message),
                            entry.exported.fds,
                        )
                    elif frame.kind == protocol.RELEASE:
                        entry_or_none = leases.pop(protocol.decode_lease(frame.payload), None)
                        if entry_or_none is not None:  # releasing twice is harmless
                            self._give_back(entry_or_none)
                    else:
                        raise ProtocolError(f"unexpected frame kind {frame.kind}")
                except NotPublishedError as exc:
                    conn.send(protocol.ERROR, protocol.encode_error(exc))
                except ProtocolError as exc:
                    _log.warning("arrow_ipc_bridge: closing session pid %s: %s", conn.peer_pid, exc)
                    conn.send(protocol.ERROR, protocol.encode_error(exc))
                    return
        finally:
            for entry in leases.values():
                self._give_back(entry)

    def _welcome(self) -> dict[str, Any]:
        return {
            "protocol": protocol.PROTOCOL_VERSION,
            "wire": list(WIRE_VERSION),
            "publisher_id": self.publisher_id,
            "pid": os.getpid(),
        }

    def _take(self, name: str) -> _Entry:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise NotPublishedError(f"nothing is published as {name!r}")
            entry.holds += 1
            self._leases += 1
            return entry

    def _give_back(self, entry: _Entry) -> None:
        with self._lock:
            self._leases -= 1
        self._drop(entry)

    # ---------- lifetime ----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._server.closed

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving (idempotent). Sessions are disconnected; what they already mapped stays valid."""
        self._server.close(timeout)
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            self._drop(entry)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
