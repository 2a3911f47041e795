"""The Flight front with GPU data (needs a CUDA GPU; skipped with the reason otherwise): a table
uploaded with ``aib.to_device`` listed as ``cuda:0`` and streamed to a plain Flight client equal to
the original (staged through pinned buffers by the front, chunk by chunk), a large batch sliced
into bounded chunks of reused buffers, a client leaving midway, ``do_put`` to ``[name, "cuda:0"]``
uploading into the GPU before it is published, and a live stream of CuPy batches staged through
the same bounded pinned pool (also with its client leaving midway)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import sample_table, wait_for

import arrow_ipc_bridge as aib

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import serve  # noqa: E402

pytestmark = pytest.mark.gpu


def _numeric_table(rows: int) -> pa.Table:
    return pa.table({f"c{i}": pa.array([float(i + r) for r in range(rows)], pa.float32()) for i in range(4)})


def test_gpu_publication_do_get(cuda_device: int, publisher: aib.Publisher) -> None:
    table = sample_table(1000, batches=2)
    device_table = aib.to_device(table, cuda_device)
    publisher.publish("gpu", device_table)
    with serve(publisher, allow_unauthenticated=True) as front, flight.connect(front.location) as client:
        (info,) = list(client.list_flights())
        assert json.loads(info.app_metadata)["device"] == f"cuda:{cuda_device}"
        assert info.total_records == 2000
        got = client.do_get(flight.Ticket(b"gpu")).read_all()
        assert_arrays_equal(got, table)
    device_table.release()
    assert wait_for(lambda: publisher.active_leases == 0, 10.0)


def test_do_put_uploads_to_the_gpu(cuda_device: int, publisher: aib.Publisher) -> None:
    table = _numeric_table(5000)
    with (
        serve(publisher, allow_unauthenticated=True, allow_put=True) as front,
        flight.connect(front.location) as client,
    ):
        writer, _ = client.do_put(flight.FlightDescriptor.for_path("up", f"cuda:{cuda_device}"), table.schema)
        writer.write_table(table)
        writer.close()
        with aib.connect(publisher.path) as session, session.get("up") as imported:
            assert imported.device == f"cuda:{cuda_device}"
            assert_arrays_equal(imported.to_host(), table)
        assert_arrays_equal(client.do_get(flight.Ticket(b"up")).read_all(), table)


def test_a_large_gpu_batch_is_staged_in_bounded_reused_pinned_chunks(
    cuda_device: int, publisher: aib.Publisher
) -> None:
    """One 8 MiB batch of fixed-width columns behind a front with 4 MiB of staging: sliced into
    2 MiB chunks, the same two or three pinned buffers serve two gets, and all come back."""
    rows = 1 << 19
    table = pa.table(
        {
            "x": pa.array(range(rows), pa.int64()),
            "y": pa.array([float(i) for i in range(rows)], pa.float32()),
            "v": pa.array([i if i % 5 else None for i in range(rows)], pa.int32()),
        }
    )
    device_table = aib.to_device(table, cuda_device)
    publisher.publish("big", device_table)
    with (
        serve(publisher, allow_unauthenticated=True, staging_bytes=4 << 20) as front,
        flight.connect(front.location) as client,
    ):
        for _ in range(2):
            reader = client.do_get(flight.Ticket(b"big"))
            batches = [chunk.data for chunk in reader]
            assert len(batches) >= 4
            assert_arrays_equal(pa.Table.from_batches(batches), table)
        pool = front._pools[cuda_device]
        assert pool.allocations <= 3
        assert pool.allocated_bytes <= 4 << 20
        assert wait_for(lambda: pool.lent == 0, 10.0), pool.lent
    device_table.release()
    assert wait_for(lambda: publisher.active_leases == 0, 10.0)


def test_a_client_leaving_a_gpu_get_midway_returns_buffers_and_lease(
    cuda_device: int, publisher: aib.Publisher
) -> None:
    table = pa.Table.from_batches(_numeric_table(1 << 18).to_batches(max_chunksize=1 << 14))
    device_table = aib.to_device(table, cuda_device)
    publisher.publish("gpu", device_table)
    with serve(publisher, allow_unauthenticated=True, staging_bytes=2 << 20) as front:
        client = flight.connect(front.location)
        reader = client.do_get(flight.Ticket(b"gpu"))
        reader.read_chunk()
        reader.cancel()
        client.close()
        pool = front._pools[cuda_device]
        assert wait_for(lambda: pool.lent == 0, 10.0), pool.lent
    device_table.release()
    assert wait_for(lambda: publisher.active_leases == 0, 10.0)


def _rows(i: int) -> int:
    """Rows of batch ``i`` of the live streams below: 64 Ki (768 KiB, one chunk), every fourth
    512 Ki (6 MiB, sliced into chunks of at most 2 MiB by a front with 4 MiB of staging)."""
    return 1 << 19 if i % 4 == 3 else 1 << 16


def _cupy_batch(cupy: Any, i: int) -> Any:
    """Batch ``i`` as CuPy columns (``aib.from_cuda_arrays``): x = row + i, n = i."""
    rows = _rows(i)
    return aib.from_cuda_arrays(
        {"x": cupy.arange(rows, dtype=cupy.float32) + i, "n": cupy.full(rows, i, dtype=cupy.int64)}
    )


def _host_batch(i: int) -> pa.Table:
    """What batch ``i`` must arrive as."""
    rows = _rows(i)
    return pa.table({"x": np.arange(rows, dtype=np.float32) + i, "n": np.full(rows, i, dtype=np.int64)})


def test_a_gpu_live_stream_goes_through_the_bounded_reused_pinned_pool(
    cuda_device: int, publisher: aib.Publisher
) -> None:
    """CuPy batches of a live stream reach a plain Flight client equal, staged through the front's
    pinned pool (4 MiB: two 2 MiB buffers, reused for every chunk), and the producer's credit is
    all back at the end."""
    cupy = pytest.importorskip("cupy")
    count = 16
    writer = publisher.open_stream("gpu", max_in_flight=2, on_slow="block", block_timeout=120)
    failures: list[BaseException] = []

    def produce() -> None:
        try:
            wait_for(lambda: writer.subscribers > 0, 60.0)
            with cupy.cuda.Device(cuda_device):
                for i in range(count):
                    writer.write(_cupy_batch(cupy, i))
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)
        finally:
            writer.close()

    producer = threading.Thread(target=produce)
    with (
        serve(publisher, allow_unauthenticated=True, staging_bytes=4 << 20, max_in_flight=2) as front,
        flight.connect(front.location) as client,
    ):
        producer.start()
        try:
            reader = client.do_get(flight.Ticket(b"gpu"), options=flight.FlightCallOptions(timeout=120))
            chunks = [chunk.data for chunk in reader]
        finally:
            producer.join(120)
        assert not failures, failures
        got = pa.Table.from_batches(chunks)
        want = pa.concat_tables([_host_batch(i) for i in range(count)])
        assert got.num_rows == want.num_rows
        for name in ("x", "n"):
            assert np.array_equal(got.column(name).to_numpy(), want.column(name).to_numpy()), name
        assert len(chunks) > count  # the large batches came as several chunks
        pool = front._pools[cuda_device]  # made by the live stream: it went through the pool
        assert pool.allocated_bytes <= 4 << 20
        assert pool.allocations <= 2, pool.allocations  # ~28 chunks, the same two buffers
        del chunks, got
        assert wait_for(lambda: pool.lent == 0, 10.0), pool.lent
    assert wait_for(lambda: writer.leases == 0, 10.0), writer.leases
    assert wait_for(lambda: publisher.active_leases == 0, 10.0), publisher.active_leases


def test_a_client_leaving_a_gpu_live_stream_midway_returns_buffers_leases_and_credit(
    cuda_device: int, publisher: aib.Publisher
) -> None:
    cupy = pytest.importorskip("cupy")
    writer = publisher.open_stream("gpu", max_in_flight=2, on_slow="drop_oldest")
    stop = threading.Event()

    def produce() -> None:
        i = 0
        with cupy.cuda.Device(cuda_device):
            while not stop.is_set():
                writer.write(_cupy_batch(cupy, i))
                i += 1
                time.sleep(0.002)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        with serve(publisher, allow_unauthenticated=True, staging_bytes=4 << 20) as front:
            client = flight.connect(front.location)
            reader = client.do_get(flight.Ticket(b"gpu"))
            reader.read_chunk()
            reader.read_chunk()
            reader.cancel()
            client.close()
            assert wait_for(lambda: writer.subscribers == 0, 10.0), "the front kept the subscription"
            assert wait_for(lambda: writer.leases == 0, 10.0), writer.leases
            pool = front._pools[cuda_device]
            assert wait_for(lambda: pool.lent == 0, 10.0), pool.lent
            assert pool.allocated_bytes <= 4 << 20
    finally:
        stop.set()
        producer.join(30)
        writer.close()
    assert wait_for(lambda: publisher.active_leases == 0, 10.0), publisher.active_leases
