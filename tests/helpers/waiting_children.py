"""Children for tests/test_waiting.py and benchmarks/bench_watch.py, started with ``spawn``."""

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


def stepping_publisher_main(conn: Any, path: str) -> None:
    """A publisher that publishes "step" = [i] (a host array) each time it is sent ("publish", i),
    answering ("published", perf_counter_ns before the publish, after it, the version); ("stop",)
    ends it."""
    with aib.Publisher(path) as pub:
        conn.send(("ready", pub.publisher_id))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            data = pa.array([command[1]], pa.int64())
            started = time.perf_counter_ns()
            pub.publish("step", data)
            ended = time.perf_counter_ns()
            conn.send(("published", started, ended, pub.version("step")))
    conn.send(("bye",))
