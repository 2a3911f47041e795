"""Children for tests/test_waiting.py, started with ``spawn``."""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib


def late_publisher_main(conn: Any, path: str, delay: float) -> None:
    """Start a publisher at ``path`` after ``delay`` seconds, publish "late" = [1, 2, 3], say
    ("published", publisher_id) and serve until told to stop."""
    time.sleep(delay)
    with aib.Publisher(path) as pub:
        pub.publish("late", pa.array([1, 2, 3]))
        conn.send(("published", pub.publisher_id))
        conn.recv()  # "stop"
    conn.send(("bye",))


def republishing_publisher_main(conn: Any, path: str) -> None:
    """Publish "v" = [0], say ("ready",), then publish [i] for each ("publish", i) and answer
    ("published", version); "stop" ends it. Killed by tests that need a dead publisher."""
    with aib.Publisher(path) as pub:
        pub.publish("v", pa.array([0]))
        conn.send(("ready",))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            pub.publish("v", pa.array([command[1]]))
            conn.send(("published", pub.version("v")))


def restarting_publisher_main(conn: Any, path: str) -> None:
    """Start a publisher at ``path``, publish "x", close it after 10 ms and start the next one,
    until told to stop; then say ("restarts", how many publishers were started)."""
    restarts = 0
    while not conn.poll():
        with aib.Publisher(path) as pub:
            restarts += 1
            pub.publish("x", pa.array([restarts]))
            time.sleep(0.01)
    conn.recv()  # "stop"
    conn.send(("restarts", restarts))
