"""``do_put`` under hostile or many uploads: ``max_put_bytes`` counts the memory an upload's batches
keep alive (not the bytes they describe), and ``max_put_total_bytes`` bounds the uploads in progress
together, refusing one more before the front reads its batches, so that its data stays with its
client (measured on a front running in a child process: its peak RSS)."""

from __future__ import annotations

import contextlib
import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import serve  # noqa: E402
from arrow_ipc_bridge.flight.uploads import held_bytes  # noqa: E402

MiB = 1 << 20

# A front in a child process, so that its memory is its own: it prints its port, then answers
# "running" (uploads in progress) and "names" (what its publisher holds) on stdin, one per line.
_FRONT = textwrap.dedent(
    """
    import json, os, sys
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge.flight import serve

    pub = aib.Publisher(os.path.join(sys.argv[1], "p.sock"))
    front = serve(pub, allow_unauthenticated=True, allow_put=True, **json.loads(sys.argv[2]))
    print(front.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "running":
            print(front.uploads_in_progress, flush=True)
        elif line.strip() == "names":
            print(json.dumps(sorted(pub.names())), flush=True)
    front.close()
    pub.close()
    """
)


class ChildFront:
    def __init__(self, directory: str, **limits: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _FRONT, directory, json.dumps(limits)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    def ask(self, question: str) -> str:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(question + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def status_mib(self, key: str) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        raise AssertionError(f"no {key} in /proc/{self.process.pid}/status")

    def reset_peak(self) -> None:
        """Peak RSS (VmHWM) starts again from the current RSS (Linux's ``clear_refs``)."""
        with open(f"/proc/{self.process.pid}/clear_refs", "w") as clear:
            clear.write("5")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            assert self.process.wait(30) == 0
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def child_front(sock_dir: str) -> Iterator[ChildFront]:
    front = ChildFront(sock_dir, max_put_bytes=4 * MiB, max_put_total_bytes=8 * MiB)
    try:
        yield front
    finally:
        front.close()


def _put(client: flight.FlightClient, name: str, table: pa.Table) -> None:
    writer, _ = client.do_put(flight.FlightDescriptor.for_path(name), table.schema)
    writer.write_table(table)
    writer.close()  # the server's answer (or refusal) comes here


@contextlib.contextmanager
def _held_uploads(
    location: str, names: list[str], table: pa.Table
) -> Iterator[list[flight.FlightStreamWriter]]:
    """Uploads of ``table`` started and left in progress (their writers not closed). Leaving
    finishes those the body did not (also when it failed: a front waits for its calls to end
    before it closes)."""
    opened = []
    try:
        for name in names:
            client = flight.connect(location)
            writer, _ = client.do_put(flight.FlightDescriptor.for_path(name), table.schema)
            opened.append((client, writer))
            writer.write_table(table)
        yield [writer for _, writer in opened]
    finally:
        for client, writer in opened:
            with contextlib.suppress(pa.ArrowException):  # finished by the body already
                writer.close()
            client.close()


def test_an_upload_past_max_put_total_bytes_is_refused_before_its_batches_are_read(
    child_front: ChildFront,
) -> None:
    """Two uploads in progress take the 8 MiB of max_put_total_bytes (4 MiB each); a third, of one
    96 MiB batch, is refused with UNAVAILABLE and the front's peak memory stays far below the batch
    (it used to receive the batch whole, twice over, before refusing it as over max_put_bytes). The
    two held uploads then publish, and their shares come back."""
    location = f"grpc://127.0.0.1:{child_front.port}"
    small = pa.table({"x": pa.array(range(1000), pa.int64())})
    big = pa.table({"x": pa.array(np.ones(96 * MiB // 8, np.int64))})
    with _held_uploads(location, ["held-1", "held-2"], small) as held:
        assert wait_for(lambda: child_front.ask("running") == "2", 10.0)
        child_front.reset_peak()
        before = child_front.status_mib("VmRSS")
        with flight.connect(location) as client, pytest.raises(pa.ArrowException) as refused:
            _put(client, "third", big)
        grown = child_front.status_mib("VmHWM") - before
        assert grown < 32, f"the front's peak RSS grew by {grown:.0f} MiB for a refused 96 MiB upload"
        assert isinstance(refused.value, flight.FlightUnavailableError), refused.value
        assert "taking 2 uploads already, as many as max_put_total_bytes" in str(refused.value)
        for writer in held:
            writer.close()
    assert json.loads(child_front.ask("names")) == ["held-1", "held-2"]
    assert child_front.ask("running") == "0"
    with flight.connect(location) as client:
        _put(client, "after", small)
    assert json.loads(child_front.ask("names")) == ["after", "held-1", "held-2"]


def test_uploads_within_max_put_total_bytes_run_together(publisher: aib.Publisher) -> None:
    """As many uploads as the total holds at max_put_bytes each run at once and all publish; the
    refusal names the limits."""
    table = pa.table({"x": pa.array(range(10_000), pa.int64())})
    with (
        serve(
            publisher,
            allow_unauthenticated=True,
            allow_put=True,
            max_put_bytes=MiB,
            max_put_total_bytes=3 * MiB,
        ) as front,
        flight.connect(front.location) as client,
    ):
        with _held_uploads(front.location, ["u0", "u1", "u2"], table) as held:
            assert wait_for(lambda: front.uploads_in_progress == 3, 10.0)
            with pytest.raises(flight.FlightUnavailableError) as refused:
                _put(client, "u3", table)
            assert f"max_put_total_bytes ({3 * MiB} bytes)" in str(refused.value)
            assert f"max_put_bytes ({MiB} bytes)" in str(refused.value)
            for writer in held:
                writer.close()  # published: the front's answer comes here
        assert front.uploads_in_progress == 0
        _put(client, "u3", table)
    assert sorted(publisher.names()) == ["u0", "u1", "u2", "u3"]


def test_max_put_bytes_counts_the_memory_an_upload_holds(publisher: aib.Publisher) -> None:
    """One row of 1,000 int8 columns describes 1,000 bytes, but each buffer of the message's body
    is padded to 8: the batch keeps 8,000 bytes alive, and a 4,000-byte limit refuses it (it was
    counted by ``nbytes`` and taken)."""
    table = pa.table({f"c{i}": pa.array([1], pa.int8()) for i in range(1000)})
    assert table.nbytes == 1000
    with (
        serve(publisher, allow_unauthenticated=True, allow_put=True, max_put_bytes=4000) as front,
        flight.connect(front.location) as client,
    ):
        with pytest.raises(
            pa.ArrowInvalid, match=r"over max_put_bytes \(4000 bytes\): its batches hold \d+ bytes"
        ):
            _put(client, "wide", table)
        assert front.uploads_in_progress == 0
    assert publisher.names() == []


def _padded_message_batch(padding: int) -> pa.RecordBatch:
    """A record batch read from an IPC message whose body is ``padding`` bytes longer than its
    buffers reach, as a hostile client can send: its buffers are slices of the whole body."""
    batch = pa.record_batch({"a": pa.array([7], pa.int64()), "b": pa.array([8], pa.int64())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    messages = pa.ipc.MessageReader.open_stream(sink.getvalue())
    messages.read_next_message()  # the schema
    message = messages.read_next_message()
    metadata, body = message.metadata.to_pybytes(), message.body.to_pybytes()
    length = struct.pack("<q", len(body))
    assert len(body) == 16
    assert metadata.count(length) == 1  # the body's length, and no buffer's
    metadata = metadata.replace(length, struct.pack("<q", len(body) + padding))
    metadata += bytes(-len(metadata) % 8)
    framed = b"\xff\xff\xff\xff" + struct.pack("<i", len(metadata)) + metadata + body + bytes(padding)
    read: pa.RecordBatch = pa.ipc.read_record_batch(pa.ipc.read_message(pa.py_buffer(framed)), batch.schema)
    return read


def test_a_batch_over_a_padded_body_counts_the_whole_body() -> None:
    batch = _padded_message_batch(8 * MiB)
    assert batch.nbytes == 16
    assert held_bytes(batch, {}) >= 8 * MiB
    roots: dict[tuple[int, int], int] = {}
    first = held_bytes(batch, roots)
    assert held_bytes(batch, roots) == 0 < first  # what the upload holds already is not counted again


def test_dictionaries_count_once_at_any_depth() -> None:
    """Dictionaries are not among an array's ``buffers()``: a struct's dictionary field is counted,
    and a dictionary shared by two batches of an upload once."""
    values = pa.array([f"value-{i}" * 100 for i in range(1000)])
    indices = pa.array([0, 1, 2], pa.int32())
    column = pa.StructArray.from_arrays([pa.DictionaryArray.from_arrays(indices, values)], names=["d"])
    batch = pa.record_batch([column], names=["s"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
        writer.write_batch(batch)
    first, second = list(pa.ipc.open_stream(sink.getvalue()))
    roots: dict[tuple[int, int], int] = {}
    assert held_bytes(first, roots) > values.nbytes
    assert held_bytes(second, roots) < values.nbytes


def test_serve_checks_max_put_total_bytes(publisher: aib.Publisher) -> None:
    with pytest.raises(ValueError, match=r"max_put_total_bytes must be an int >= max_put_bytes \(4096\)"):
        serve(publisher, allow_unauthenticated=True, max_put_bytes=4096, max_put_total_bytes=4095)
    with pytest.raises(ValueError, match="max_put_total_bytes must be an int"):
        serve(publisher, allow_unauthenticated=True, max_put_total_bytes=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_put_total_bytes must be an int"):
        serve(publisher, allow_unauthenticated=True, max_put_total_bytes=float(8 << 30))  # type: ignore[arg-type]
    # The default takes one upload at a time.
    table = pa.table({"x": [1, 2, 3]})
    with (
        serve(publisher, allow_unauthenticated=True, allow_put=True, max_put_bytes=MiB) as front,
        flight.connect(front.location) as client,
        _held_uploads(front.location, ["one"], table) as held,
    ):
        assert wait_for(lambda: front.uploads_in_progress == 1, 10.0)
        with pytest.raises(flight.FlightUnavailableError, match="taking 1 upload already"):
            _put(client, "two", table)
        held[0].close()
    assert publisher.names() == ["one"]


def test_an_upload_whose_client_dies_midway_is_not_published(publisher: aib.Publisher) -> None:
    """A client process that exits after one batch, without finishing its upload: the front's reader
    ends as at a finished upload, but nothing is published (it used to publish the part it got),
    and the upload's share comes back."""
    client_script = textwrap.dedent(
        """
        import os, sys
        import pyarrow as pa, pyarrow.flight as flight
        table = pa.table({"x": pa.array(range(1000))})
        client = flight.connect(sys.argv[1])
        writer, _ = client.do_put(flight.FlightDescriptor.for_path("partial"), table.schema)
        writer.write_table(table)
        os._exit(0)
        """
    )
    with serve(publisher, allow_unauthenticated=True, allow_put=True) as front:
        subprocess.run([sys.executable, "-c", client_script, front.location], check=True, timeout=60)
        assert wait_for(lambda: front.uploads_in_progress == 0, 10.0)
        assert publisher.names() == []
        with flight.connect(front.location) as client:
            _put(client, "whole", pa.table({"x": [1, 2]}))
    assert publisher.names() == ["whole"]
