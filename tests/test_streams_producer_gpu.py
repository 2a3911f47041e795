"""The writer's one path with CUDA data from a foreign producer (marker: gpu): an object whose
``__arrow_c_device_array__`` answers CUDA memory reaches the ring's C call, which turns it away
(device data is not the ring's), and the batch is exported as CUDA data; no ring segment is made."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.gpu
_CTX = mp.get_context("spawn")
_BATCHES = 4


@pytest.fixture
def sock_path() -> Iterator[str]:
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-gpu-")
    yield os.path.join(directory, "s.sock")
    shutil.rmtree(directory, ignore_errors=True)


class _ForeignDeviceBatch:
    """A producer the bridge did not make: only the device-array method, delegating."""

    def __init__(self, source: object) -> None:
        self._source = source

    def __arrow_c_device_array__(
        self, requested_schema: object = None, **kwargs: object
    ) -> tuple[object, object]:
        return self._source.__arrow_c_device_array__(requested_schema)  # type: ignore[attr-defined,no-any-return]


def foreign_cuda_producer(path: str, conn: Connection) -> None:
    """Writes _BATCHES batches of CUDA columns (batch i holds i and -i) through the foreign
    wrapper; answers the ring's segment count, then keeps the memory until told to stop."""
    import cupy

    try:
        with aib.Publisher(path) as pub:
            writer = pub.open_stream("s", max_in_flight=2)
            conn.send(("ready", None))
            deadline = time.monotonic() + 60
            while writer.subscribers < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            for i in range(_BATCHES):
                columns = {
                    "x": cupy.full(256, i, dtype=cupy.float32),
                    "y": cupy.full(256, -i, dtype=cupy.float32),
                }
                writer.write(_ForeignDeviceBatch(aib.from_cuda_arrays(columns)))
            segments = writer._ring.segments
            writer.close()
            conn.send(("done", segments))
            conn.recv()  # "stop": the consumer released every batch
    except Exception:
        conn.send(("error", traceback.format_exc()))


def test_a_foreign_cuda_batch_is_exported_not_placed_in_the_ring(cuda_device: int, sock_path: str) -> None:
    import cupy

    parent, child = _CTX.Pipe()
    producer = _CTX.Process(target=foreign_cuda_producer, args=(sock_path, child))
    producer.start()
    try:
        assert parent.poll(120), "producer did not start"
        status, detail = parent.recv()
        assert status == "ready", detail
        with aib.subscribe(sock_path, "s", timeout=60) as live:
            for i in range(_BATCHES):
                imported = live.next_batch()
                assert imported is not None
                with imported:
                    assert imported.device_type == 2  # CUDA, as written
                    assert float(cupy.asarray(aib.column_view(imported, 0))[7]) == i
                    assert float(cupy.asarray(aib.column_view(imported, 1))[255]) == -i
            assert live.next_batch() is None
        assert parent.poll(60), "producer did not finish"
        status, detail = parent.recv()
        assert status == "done", detail
        assert detail == 0  # turned away before any ring segment was made
    finally:
        parent.send("stop")
        producer.join(60)
        if producer.exitcode is None:
            producer.kill()
            producer.join()
    assert producer.exitcode == 0
