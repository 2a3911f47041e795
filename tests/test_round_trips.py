"""Round trips across processes: every Arrow type through a producer child and back, 50-batch
streams, ``export`` + ``Session().import_message`` over a socketpair with ``SCM_RIGHTS``, and a message
bigger than the C channel's buffer.

The producer child (``session_children.producer_main``, the ``producer`` fixture, "spawn") publishes
what this process sends it, or relays an object it ``get``s from a publisher here (this process ->
child -> this process, all through the bridge, no serialization); the relay child
(``session_children.fd_relay_main``) imports each message it is sent and exports it back.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers import session_children as children
from helpers.arrow_equality import assert_arrays_equal
from helpers.arrow_values import tables
from helpers.counting import SessionCounts
from helpers.session_rig import (
    ANY_ARROW,
    EXAMPLES,
    HYPOTHESIS_WITH_FIXTURES,
    JOIN_S,
    ProducerRig,
    child_env,
    fd_count,
    materialize,
    null_batch,
    sample_table,
    settle,
    wait_for,
)
from hypothesis import given, reject, settings
from hypothesis import strategies as st

import arrow_ipc_bridge as aib

pytestmark = pytest.mark.usefixtures("no_leaks")


def relay_round_trip(rig: ProducerRig, obj: Any, name: str = "x") -> None:
    """Publish ``obj`` here, have the child ``get`` and republish it, ``get`` it back and compare; then
    check that every lease of the chain ends in both processes."""
    rig.upstream.publish(name, obj)
    stats = rig.child.call("relay", name)[1]
    assert stats["copied_bytes"] >= 0
    with rig.session.get(name) as imported:
        got = materialize(imported, obj)
        # The child's export holds the array structs of its import while one of its regions is
        # zero-copy (the import's own mapping), so its lease on us lasts until it unpublishes; an
        # export that copied every buffer lets go of its source at once (docs/lifetime.md, 2.), and a
        # stream without batches has no array struct (the schema needs no lease).
        holds_arrays = stats["zero_copy_regions"] > 0 and (
            isinstance(imported, aib.ImportedArray) or imported.batch_count > 0
        )
    if holds_arrays:
        assert rig.upstream.active_leases == 1
    else:
        assert wait_for(lambda: rig.upstream.active_leases == 0, 5.0)
    assert_arrays_equal(got, obj)
    del got
    settle()
    assert wait_for(lambda: rig.child.state()[0] == 0, 5.0), "our lease on the child did not end"
    rig.child.call("unpublish", name)
    rig.upstream.unpublish(name)
    assert wait_for(lambda: rig.upstream.active_leases == 0, 5.0), "the child's lease on us did not end"


@HYPOTHESIS_WITH_FIXTURES
@given(obj=ANY_ARROW)
def test_relay_round_trip_all_types(producer: ProducerRig, obj: Any) -> None:
    """Any array, record batch or table (every Arrow type, nulls, slices, nesting, metadata) published here,
    imported by the producer child and republished from its own imported object, comes back equal; the
    leases of both hops end once the pyarrow objects are dropped and the names unpublished."""
    relay_round_trip(producer, obj)


@HYPOTHESIS_WITH_FIXTURES
@given(obj=ANY_ARROW, data=st.data())
def test_producer_child_publishes_its_own_data(producer: ProducerRig, obj: Any, data: st.DataObject) -> None:
    """Data that lives in the producer child's own pyarrow memory (rebuilt there from Arrow IPC bytes, then
    often sliced to a non-zero offset) arrives equal to the same rebuild done here. (Arrow IPC is lossy for
    a few exotic types; the relay test above covers every type exactly.)"""
    try:
        kind, payload = children.to_ipc(obj)
        expected = children.from_ipc(kind, payload)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        reject()  # Arrow IPC itself cannot carry this (e.g. a dictionary of uuid): not what is tested here
    window = None
    n = len(expected) if kind == "array" else expected.num_rows
    if n and data.draw(st.booleans(), label="slice"):
        offset = data.draw(st.integers(0, n), label="offset")
        window = (offset, data.draw(st.integers(0, n - offset), label="length"))
        expected = expected.slice(*window)
    producer.child.call("ipc", "x", kind, payload, window)
    with producer.session.get("x") as imported:
        got = materialize(imported, kind)
    assert_arrays_equal(got, expected)
    del got
    settle()
    assert wait_for(lambda: producer.child.state()[0] == 0, 5.0)


def stream_batch_count(table: pa.Table) -> int:
    """How many batches pyarrow's own C stream of ``table`` yields (it skips empty chunks)."""
    return sum(1 for _ in pa.RecordBatchReader.from_stream(table))


def check_fifty(rig: ProducerRig, table: pa.Table) -> None:
    relay_round_trip(rig, table, name="fifty")
    try:
        kind, payload = children.to_ipc(table)
        expected = children.from_ipc(kind, payload)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return  # Arrow IPC itself cannot carry this (e.g. a dictionary of uuid); the relay covered it
    rig.child.call("ipc", "fifty", kind, payload, None)
    with rig.session.get("fifty") as imported:
        assert isinstance(imported, aib.ImportedStream)
        assert imported.batch_count == stream_batch_count(expected)
        got = pa.table(imported)
    assert len(got.to_batches()) == stream_batch_count(expected)
    assert_arrays_equal(got, expected)


@settings(HYPOTHESIS_WITH_FIXTURES, max_examples=max(3, EXAMPLES // 12))
@given(table=tables(min_batches=50, max_batches=50, max_rows=5, min_columns=1, max_columns=4))
def test_tables_with_50_batches_both_ways(producer: ProducerRig, table: pa.Table) -> None:
    """A 50-batch table crosses the relay (both directions) and the child's own-memory path with every
    batch (as many as pyarrow's own stream yields: it skips empty chunks) and equal data."""
    check_fifty(producer, table)


def test_fifty_non_empty_batches_arrive_as_fifty(producer: ProducerRig) -> None:
    """A table of 50 non-empty batches arrives as exactly 50 batches, both ways."""
    table = sample_table(20, batches=50)
    assert stream_batch_count(table) == 50
    check_fifty(producer, table)


@pytest.fixture
def fd_relay() -> Iterator[socket.socket]:
    """A subprocess running ``fd_relay_main`` on one end of a socketpair; this test holds the other."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, helpers.session_children as c; c.fd_relay_main(int(sys.argv[1]))",
            str(theirs.fileno()),
        ],
        pass_fds=[theirs.fileno()],
        env=child_env(),
    )
    theirs.close()
    ours.settimeout(30.0)
    try:
        yield ours
        children.send_message(ours, b"", [])
        assert proc.wait(timeout=JOIN_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(JOIN_S)
        ours.close()


@HYPOTHESIS_WITH_FIXTURES
@given(obj=ANY_ARROW)
def test_export_import_message_across_processes(fd_relay: socket.socket, obj: Any) -> None:
    """``aib.export`` here, message + fds through SCM_RIGHTS to a child that imports it with
    ``Session().import_message``, re-exports the imported object and sends it back the same way: the
    object that arrives equals the original. Our export is closed right after sending, and the child is
    told to close its own as soon as our import holds its mappings: the mappings keep the data. No fd is
    left open."""
    before = fd_count()
    exported = aib.export(obj)
    children.send_message(fd_relay, exported.message, exported.fds)
    exported.close()
    message, fds = children.recv_message(fd_relay)
    assert not message.startswith(b"ERROR:"), message.decode(errors="replace")
    with aib.Session() as session:
        try:
            imported = session.import_message(message, fds)
        finally:
            for fd in fds:
                os.close(fd)
        fd_relay.sendall(b"k")  # the child closes its export now
        with imported:
            got = materialize(imported, obj)
    assert_arrays_equal(got, obj)
    del got
    assert fd_count() == before


def test_frames_over_64_kib_cross_the_c_channel(publisher: aib.Publisher) -> None:
    """A message bigger than the channel's 64 KiB buffer (5,000 columns) goes through the C framing's
    large-frame path in both directions, and is then remembered like any other."""
    counts = SessionCounts()
    expected = null_batch(5000, 3)
    publisher.publish("wide", expected)
    with aib.connect(publisher.path, timeout=10.0) as session:
        for _ in range(3):
            with session.get("wide") as imported:
                assert pa.record_batch(imported).equals(expected)
        assert counts.remembered_gets == 2
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)
