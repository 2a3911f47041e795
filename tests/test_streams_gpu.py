"""Live streams of CUDA batches across processes (marker: gpu): reserved slots through the slab
allocator and writes of CuPy arrays; each batch's event is honoured, so the consumer never sees a
half-written batch (the producer commits while its kernel still runs)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from helpers import stream_children

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.gpu
_CTX = mp.get_context("spawn")


@pytest.fixture
def sock_path() -> Iterator[str]:
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-gpu-")
    yield os.path.join(directory, "s.sock")
    shutil.rmtree(directory, ignore_errors=True)


def _consume(path: str, batches: int, rows: int) -> list[int]:
    import cupy

    seen = []
    with aib.subscribe(path, "gpu", max_in_flight=2, timeout=120) as live:
        for imported in live:
            with imported:
                assert imported.device_type == 2  # CUDA
                sequence = live.last_sequence
                for column in (0, 7, 15):
                    # column_view without a stream waits on the host for the batch's event
                    values = cupy.asarray(aib.column_view(imported, column))
                    assert values.shape == (rows,)
                    assert bool((values == sequence).all()), f"batch {sequence} column {column} half-written"
            seen.append(sequence)
    assert live.dropped == 0
    return seen


@pytest.mark.parametrize("mode", ["slots", "write"])
def test_a_cuda_stream_is_never_seen_half_written(cuda_device: int, sock_path: str, mode: str) -> None:
    batches, rows = 40, 1 << 16
    ready, done = _CTX.Event(), _CTX.Event()
    child = _CTX.Process(
        target=stream_children.cuda_producer_main,
        args=(sock_path, (ready, done), batches, rows, mode),
        daemon=True,
    )
    child.start()
    try:
        assert ready.wait(120)
        before = aib.stats()
        assert _consume(sock_path, batches, rows) == list(range(batches))
        after = aib.stats()
        if mode == "slots":
            # The slots' messages are remembered after their first batch (4 slots): the rest are
            # imported with nothing opened.
            assert after.session.python_imports - before.session.python_imports <= 4
        else:
            # Fresh CuPy arrays per batch come out of CuPy's pool, whose allocations (legacy
            # handles) and the producer's pooled events this process opened for earlier batches:
            # those batches are imported by the C core (aib_import_new), as a GET's new message is,
            # and their values were checked above like the others'.
            assert after.cuda.c_imports > before.cuda.c_imports, (before.cuda, after.cuda)
            assert after.session.new_message_gets - before.session.new_message_gets == (
                after.cuda.c_imports - before.cuda.c_imports
            )
    finally:
        done.set()
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


def test_cuda_slots_in_one_process(cuda_device: int, sock_path: str) -> None:
    """Producer and consumer in one process (CUDA refuses to open its own IPC handles: the
    bridge resolves them from its own export records)."""
    import cupy
    import pyarrow as pa

    schema = pa.schema([("x", pa.float32()), ("y", pa.float32())])
    with aib.Publisher(sock_path) as pub:
        writer = pub.open_stream(
            "s", max_in_flight=2, slots=aib.SlotLayout(schema, rows=1024, count=3, device="cuda")
        )
        with aib.subscribe(pub.path, "s", timeout=60) as live:
            for i in range(10):
                slot = writer.reserve(timeout=30)
                slot.columns[0].fill(i)
                slot.columns[1].fill(-i)
                slot.commit()
                imported = live.next_batch()
                assert imported is not None
                with imported:
                    assert float(cupy.asarray(aib.column_view(imported, 0))[5]) == i
                    assert float(cupy.asarray(aib.column_view(imported, 1))[1023]) == -i
            writer.close()
            assert live.next_batch() is None
