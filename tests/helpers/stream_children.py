"""Children (spawn) for the live-stream tests: a producer that streams until killed, and a consumer
that holds batches until killed."""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

import arrow_ipc_bridge as aib


def streaming_producer_main(path: str, ready: Any) -> None:
    """Publish the stream "live" at ``path`` from reserved host slots, forever (until killed)."""
    schema = pa.schema([("i", pa.int64())])
    with aib.Publisher(path) as pub:
        writer = pub.open_stream("live", max_in_flight=4, slots=aib.SlotLayout(schema, rows=8))
        ready.set()
        i = 0
        while True:
            try:
                slot = writer.reserve(timeout=60)
            except aib.StreamBlockedError:
                continue
            slot.columns[0][:] = i
            slot.commit()
            i += 1


def holding_consumer_main(path: str, name: str, hold: int, ready: Any) -> None:
    """Subscribe, take ``hold`` batches without releasing them, signal, sleep until killed."""
    live = aib.subscribe(path, name, timeout=60)
    held = [live.next_batch() for _ in range(hold)]
    assert all(b is not None for b in held)
    ready.set()
    time.sleep(600)
