"""Bring your own channel, the multiprocessing way: the message and its file descriptors over a
``multiprocessing.Pipe`` to a child process.

A ``multiprocessing`` connection carries bytes (``send_bytes``) and, on Unix, file descriptors:
``multiprocessing.reduction.send_handle(connection, fd, pid)`` sends one (the receiver gets a
descriptor of its own with ``recv_handle``). The producer sends the message, the number of
descriptors, then each of them; the consumer imports them with
``aib.Session().import_message(message, fds)`` and closes the descriptors it received.

The same works for a ``multiprocessing.Pool`` or ``concurrent.futures.ProcessPoolExecutor`` worker
reached through a pipe of your own; data sent through their queues is pickled (copied) instead.

Run: ``python examples/own_multiprocessing.py``
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np
import pyarrow as pa

import arrow_ipc_bridge as aib

ROWS = 1_000_000


def consumer(connection: Connection) -> None:
    """Receive a message and its descriptors, import them, answer with the sum of column "x"."""
    message = connection.recv_bytes()
    count = connection.recv()
    fds = [recv_handle(connection) for _ in range(count)]
    try:
        session = aib.Session()
        imported = session.import_message(message, fds)
    finally:
        for fd in fds:  # borrowed by import_message: closing them is the receiver's job
            os.close(fd)
    with imported:
        batch = pa.record_batch(imported)
        total = int(np.asarray(batch.column("x")).sum())  # a read-only view of the shared memory
        print(f"consumer: imported {batch.num_rows} rows from {count} fd(s), sum of x {total}", flush=True)
        del batch
    session.close()
    connection.send(total)


def main() -> int:
    batch = pa.record_batch({"x": np.arange(ROWS, dtype=np.int64), "y": np.ones(ROWS)})
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=consumer, args=(theirs,), daemon=True)
    child.start()
    theirs.close()  # the child has its own copy of this end
    try:
        with aib.export(batch) as exported:  # keep it until the consumer answered
            ours.send_bytes(exported.message)
            ours.send(len(exported.fds))
            for fd in exported.fds:
                send_handle(ours, fd, child.pid)
            if not ours.poll(60):
                raise TimeoutError("the consumer did not answer")
            total = ours.recv()
        expected = ROWS * (ROWS - 1) // 2
        print(f"producer: the consumer's sum {total}, expected {expected}", flush=True)
        child.join(timeout=60)
    finally:
        if child.is_alive():
            child.terminate()
        child.join()
        ours.close()
    if child.exitcode != 0 or total != expected:
        print("producer: the consumer failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
