"""Lease semantics: a lease lasts while pyarrow, polars or nanoarrow hold the data, and ends when the
imported object, its session or the last struct built from it goes; leases imported by the C core
behave the same; nothing is left after all tests of this file.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import nanoarrow as na
import polars as pl
import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.counting import SessionCounts
from helpers.session_rig import FakePublisher, assert_back_to, null_batch, sample_table, settle, wait_for
from helpers.wire_craft import encode_item

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.runtime import reaper
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_lease_lasts_until_pyarrow_lets_go(publisher: aib.Publisher) -> None:
    """get -> pa.table -> release the imported object: the publisher still counts the lease (the table
    holds the structs); dropping the table ends it shortly after. Releasing twice is harmless; using a
    released object raises ClosedError."""
    expected = sample_table(1000)
    publisher.publish("t", expected)
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        table = pa.table(imported)
        imported.release()
        assert imported.released
        time.sleep(0.1)
        assert publisher.active_leases == 1
        assert_arrays_equal(table, expected)
        imported.release()
        with pytest.raises(aib.ClosedError) as raised:
            pa.table(imported)
        assert raised.value.reason == "released"
        assert publisher.active_leases == 1
        del table
        gc.collect()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_dropping_imported_without_release_ends_the_lease(publisher: aib.Publisher) -> None:
    """An imported object that is just dropped (never released) gives its lease back once collected."""
    publisher.publish("t", sample_table(100))
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        assert publisher.active_leases == 1
        del imported
        gc.collect()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)


CONSUMERS: dict[str, Callable[[Any], Any]] = {
    "pyarrow": pa.table,
    "polars": pl.DataFrame,
    "nanoarrow-array": na.Array,
    "nanoarrow-stream": lambda imported: na.ArrayStream(imported).read_all(),
}


def rows_of(built: Any) -> list[tuple[Any, Any]]:
    if isinstance(built, pa.Table):
        return list(zip(built["i"].to_pylist(), built["s"].to_pylist(), strict=True))
    if isinstance(built, pl.DataFrame):
        return list(zip(built["i"].to_list(), built["s"].to_list(), strict=True))
    return [(row["i"], row["s"]) for row in built.to_pylist()]


@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_any_consumer_holds_the_lease(publisher: aib.Publisher, consumer: str) -> None:
    """What pyarrow, polars or nanoarrow build from an imported table keeps the lease (and the data) after
    the imported object is released and the name unpublished; dropping it ends the lease."""
    ids = list(range(3000))
    expected = [(i if i % 3 else None, f"s{i}" if i % 4 else None) for i in ids]
    publisher.publish("t", pa.table({"i": [e[0] for e in expected], "s": [e[1] for e in expected]}))
    with aib.connect(publisher.path, timeout=5.0) as session:
        imported = session.get("t")
        built = CONSUMERS[consumer](imported)
        imported.release()
        publisher.unpublish("t")
        settle()
        assert publisher.active_leases == 1
        assert rows_of(built) == expected
        del built
        settle()
        assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_session_close_releases_everything(publisher: aib.Publisher) -> None:
    """``session.close()`` releases every imported object it handed out and ends all its leases; tables
    built before stay valid, even after the publisher itself is closed."""
    expected = sample_table(500)
    publisher.publish("a", expected)
    publisher.publish("b", expected.slice(100, 50))
    session = aib.connect(publisher.path, timeout=5.0)
    held = [session.get("a"), session.get("b"), session.get("a")]
    kept = pa.table(held[0])
    assert publisher.active_leases == 3
    session.close()
    session.close()
    assert all(imported.released for imported in held)
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: publisher.active_sessions == 0, 2.0)
    with pytest.raises(aib.BridgeError, match="closed"):
        session.get("a")
    publisher.close()
    assert_arrays_equal(kept, expected)


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_session_dropped_without_close_gives_everything_back(publisher: aib.Publisher) -> None:
    """A session that is simply dropped (never closed), with its imported object and a table built from
    it, keeps its lease while the table lives; once everything is collected the lease ends and the
    connection goes away."""
    publisher.publish("t", sample_table(100))
    session = aib.connect(publisher.path, timeout=5.0)
    imported = session.get("t")
    table = pa.table(imported)
    del session, imported
    settle()
    assert publisher.active_leases == 1
    assert table.num_rows == 100
    del table

    def all_given_back() -> bool:
        settle()
        return publisher.active_leases == 0 and publisher.active_sessions == 0

    assert wait_for(all_given_back, 2.0)


def test_lazy_stream_reader_outlives_everything(publisher: aib.Publisher) -> None:
    """A pyarrow RecordBatchReader opened on an imported stream and read one batch at a time keeps working
    after the imported object is released, the name unpublished and the session closed."""
    expected = sample_table(1000, batches=5)
    publisher.publish("t", expected)
    session = aib.connect(publisher.path, timeout=5.0)
    imported = session.get("t")
    reader = pa.RecordBatchReader.from_stream(imported)
    first = reader.read_next_batch()
    imported.release()
    publisher.unpublish("t")
    session.close()
    settle()
    rest = reader.read_all()
    assert_arrays_equal(pa.Table.from_batches([first, *rest.to_batches()]), expected)


def test_zz_nothing_left_after_all_tests(warm: dict[str, int]) -> None:
    """After every test above: open fds, live owners/nodes/mappings, reaper callbacks and threads are
    back to what they were before the first test (runs last in this file)."""
    assert_back_to(warm)


def test_lease_ids_the_token_cannot_carry_take_the_python_path(sock_dir: str) -> None:
    """Leases imported by the C core carry their id in the owner's token (a reaper family, 40 bits). A
    publisher answering with lease ids 0 or from 2**40 on is served by the Python path, and each
    RELEASE names the id the publisher gave."""
    counts = SessionCounts()
    message = aib.export(null_batch(2, 5)).message
    big = (1 << reaper.FAMILY_VALUE_BITS) + 7
    leases = [1, 2, big, 0, (1 << 64) - 1, 3]
    replies: list[Any] = [(protocol.ITEM, encode_item(lease, message), []) for lease in leases]
    fake = FakePublisher(os.path.join(sock_dir, "f.sock"), replies=replies)
    with fake, aib.connect(fake.path, timeout=5.0) as session:
        for lease in leases:
            with session.get("x") as imported:
                assert pa.record_batch(imported).num_rows == 5
            assert fake.releases.get(timeout=5.0) == lease
        assert counts.remembered_gets == 2  # leases 2 and 3


def test_c_imported_leases_outlive_their_session_object(publisher: aib.Publisher) -> None:
    """A session dropped without close() while structs of C-imported leases live on: the connection
    stays open for them, each lease ends when its struct is released, and then the session's reaper
    family is retired (nothing of it stays registered). ``pool_linger=0``: every get asks and takes a
    lease of its own (the standing lease's case is the next test)."""
    counts = SessionCounts()
    publisher.publish("t", null_batch(3, 10))
    families_before = len(reaper._families)
    session = aib.connect(publisher.path, timeout=5.0, pool_linger=0)
    session.get("t").release()  # the first get remembers the message
    kept = []  # capsule pairs: their structs hold the leases (pyarrow lets go of buffer-less data)
    for _ in range(3):
        with session.get("t") as imported:
            kept.append(imported.__arrow_c_device_array__())
    assert counts.remembered_gets == 3
    assert len(reaper._families) == families_before + 1
    del session, imported
    gc.collect()
    assert wait_for(lambda: publisher.active_leases == 3, 2.0)
    assert publisher.active_sessions == 1
    kept.pop()
    gc.collect()
    assert wait_for(lambda: publisher.active_leases == 2, 2.0)
    kept.clear()
    gc.collect()
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: len(reaper._families) == families_before, 2.0)
    gc.collect()
    assert wait_for(lambda: publisher.active_sessions == 0, 2.0)


def test_a_standing_lease_outlives_its_session_object_until_its_last_import(publisher: aib.Publisher) -> None:
    """By default re-gets after the second are local, under one standing lease: a session dropped
    without close() while structs of those gets live on keeps that one lease (and its connection)
    until the last struct is released, whatever the linger, then gives it back and retires its
    reaper family."""
    counts = SessionCounts()
    publisher.publish("t", null_batch(3, 10))
    families_before = len(reaper._families)
    session = aib.connect(publisher.path, timeout=5.0, pool_linger=60.0)
    session.get("t").release()  # the first get remembers the message
    kept = []  # capsule pairs: their structs hold the imports (pyarrow lets go of buffer-less data)
    for _ in range(3):
        with session.get("t") as imported:
            kept.append(imported.__arrow_c_device_array__())
    assert counts.remembered_gets == 3
    assert counts.local_gets == 2  # the second get took the standing lease, the others used it
    assert wait_for(lambda: publisher.active_leases == 1, 2.0)
    del session, imported
    gc.collect()
    assert publisher.active_sessions == 1
    kept.pop()
    kept.pop()
    gc.collect()
    time.sleep(0.2)  # a lease given back too early would show by now
    assert publisher.active_leases == 1
    kept.clear()
    gc.collect()
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: len(reaper._families) == families_before, 2.0)
    gc.collect()
    assert wait_for(lambda: publisher.active_sessions == 0, 2.0)
