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
            except aib.BridgeTimeoutError:
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


# A kernel that spins (so the batch is still being written when it is committed), then writes.
_SLOW_FILL = r"""
extern "C" __global__ void slow_fill(float* x, int n, float value, long long spin) {
    long long start = clock64();
    while (clock64() - start < spin) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}
"""


def cuda_producer_main(path: str, events: tuple[Any, Any], batches: int, rows: int, mode: str) -> None:
    """Stream ``batches`` CUDA batches of 16 float32 columns as "gpu": ``mode`` "slots" fills
    reserved slots with a slow kernel and commits at once (the event must cover the kernel);
    "write" writes fresh CuPy arrays through ``aib.from_cuda_arrays``. Batch i holds i everywhere.
    ``events``: (ready, done): set when the stream is open; waited for before the memory goes."""
    import cupy

    ready, done = events

    schema = pa.schema([(f"c{k}", pa.float32()) for k in range(16)])
    kernel = cupy.RawKernel(_SLOW_FILL, "slow_fill")
    with aib.Publisher(path) as pub:
        if mode == "slots":
            layout = aib.SlotLayout(schema, rows=rows, count=4, device="cuda")
            writer = pub.open_stream("gpu", max_in_flight=2, slots=layout, block_timeout=120)
        else:
            writer = pub.open_stream("gpu", max_in_flight=2, block_timeout=120)
        ready.set()
        while writer.subscribers == 0:
            time.sleep(0.001)
        threads = 256
        blocks = (rows + threads - 1) // threads

        def slow_fill(column: Any, value: int) -> None:
            kernel(
                (blocks,), (threads,), (column, cupy.int32(rows), cupy.float32(value), cupy.int64(2_000_000))
            )

        for i in range(batches):
            if mode == "slots":
                slot = writer.reserve(timeout=120)
                for column in slot.columns:
                    kernel(
                        (blocks,),
                        (threads,),
                        (column, cupy.int32(rows), cupy.float32(i), cupy.int64(2_000_000)),
                    )
                slot.commit()  # no synchronize: consumers wait on the batch's event
            else:
                columns = {f"c{k}": cupy.empty(rows, dtype=cupy.float32) for k in range(16)}
                for column in columns.values():
                    kernel(
                        (blocks,),
                        (threads,),
                        (column, cupy.int32(rows), cupy.float32(i), cupy.int64(2_000_000)),
                    )
                writer.write(aib.from_cuda_arrays(columns))
        writer.close()
        done.wait(120)  # the consumer released everything before the memory goes
