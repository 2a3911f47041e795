"""Bring your own channel: send the bridge's message and file descriptors over your own Unix socket.

No ``Publisher`` and no session protocol: the producer calls ``aib.export(table)`` and gets
``exported.message`` (a few hundred bytes of metadata) and ``exported.fds`` (the shared memory);
it sends both in one ``socket.send_fds`` call. The consumer receives them with
``socket.recv_fds``, imports them with ``aib.Session().import_message(message, fds)`` and closes
the descriptors it received (the import keeps what it needs).

The socket is ``SOCK_SEQPACKET``: each send arrives as one record, message and descriptors
together, so no framing is needed. On a ``SOCK_STREAM`` socket, send a length first and attach the
descriptors to the first byte of the message. The receiver checks ``MSG_TRUNC`` / ``MSG_CTRUNC``:
a message or descriptor list cut short by the kernel must not be imported.

Whoever holds the socket's other end is trusted to send only what you expect: the bridge checks
every message it imports (decoding it as hostile input, and every offset of host data), but the
channel's access control is yours (file mode, ``SO_PEERCRED``).

Run: ``python examples/own_socket.py``
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import sys
import tempfile

import pyarrow as pa
import pyarrow.compute as pc

import arrow_ipc_bridge as aib

MAX_MESSAGE = 1 << 20  # bytes a record may have; the bridge's messages are far smaller
MAX_FDS = 253  # the kernel's limit of descriptors in one message (SCM_MAX_FD)


def consumer(path: str) -> None:
    """Connect to the producer's socket, receive one message with its fds, import it, reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.connect(path)
        message, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise RuntimeError("the message or its descriptors were cut short")
            session = aib.Session()
            imported = session.import_message(message, fds)
        finally:
            for fd in fds:  # borrowed by import_message: closing them is the receiver's job
                os.close(fd)
        with imported:
            table = pa.table(imported)
            print(
                f"consumer: received {len(message)} bytes and {len(fds)} fd(s), "
                f"imported {table.num_rows} rows {table.column_names}",
                flush=True,
            )
            print(
                f"consumer: total qty {pc.sum(table['qty']).as_py()}, "
                f"symbols {sorted(set(table['symbol'].to_pylist()))}",
                flush=True,
            )
            del table
        session.close()
        sock.sendall(b"done")  # the producer may drop its export now


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "channel.sock")
    table = pa.table({"symbol": ["AAPL", "MSFT", "NVDA"] * 1000, "qty": list(range(3000))})
    child = None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
            server.bind(path)
            os.chmod(path, 0o600)  # only this user may connect
            server.listen(1)
            child = multiprocessing.get_context("spawn").Process(target=consumer, args=(path,), daemon=True)
            child.start()
            server.settimeout(60)
            connection, _ = server.accept()
            with connection, aib.export(table) as exported:
                print(
                    f"producer: exported {len(exported.message)} bytes of metadata and "
                    f"{len(exported.fds)} fd(s), {exported.stats.copied_bytes} bytes copied once",
                    flush=True,
                )
                socket.send_fds(connection, [exported.message], exported.fds)
                connection.settimeout(60)
                reply = connection.recv(16)
                print(f"producer: the consumer said {reply.decode()!r}", flush=True)
        child.join(timeout=60)
    finally:
        if child is not None:
            if child.is_alive():
                child.terminate()
            child.join()
        shutil.rmtree(directory, ignore_errors=True)
    if child is None or child.exitcode != 0:
        print("producer: the consumer failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
