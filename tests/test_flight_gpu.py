"""The Flight front with GPU data (needs a CUDA GPU; skipped with the reason otherwise): a table
uploaded with ``aib.to_device`` listed as ``cuda:0`` and streamed to a plain Flight client equal to
the original (staged through pinned buffers by the front, chunk by chunk), a large batch sliced
into bounded chunks of reused buffers, a client leaving midway, and ``do_put`` to
``[name, "cuda:0"]`` uploading into the GPU before it is published."""

from __future__ import annotations

import json

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
