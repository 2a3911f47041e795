"""The steady state in the C core: re-gets of an unchanged publication are imported from the
remembered message (by bytes and files), ``forget`` drops them, the number remembered is bounded,
and churn across threads or a descriptor on remembered bytes takes the checked path.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import os
import threading
import time

import pyarrow as pa
import pytest
from helpers.counting import SessionCounts
from helpers.session_rig import JOIN_S, FakePublisher, fd_count, null_batch, wait_for
from helpers.wire_craft import encode_item

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import lib
from arrow_ipc_bridge.transport import protocol

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_remembered_message_is_imported_by_the_c_core(publisher: aib.Publisher) -> None:
    """The second and later gets of an unchanged publication are imported by aib_session_get (counted in
    ``remembered_gets``): same data, a lease per get, each given back on release."""
    counts = SessionCounts()
    expected = null_batch(16, 1000)
    publisher.publish("t", expected)
    with aib.connect(publisher.path, timeout=5.0) as session:
        for i in range(50):
            with session.get("t") as imported:
                assert publisher.active_leases == 1
                assert counts.remembered_gets == i
                schema, array = imported.__arrow_c_device_array__()
                got = pa.RecordBatch._import_from_c_device_capsule(schema, array)
                assert got.equals(expected)
                del got, schema, array
            assert wait_for(lambda: publisher.active_leases == 0, 2.0)
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_forget_drops_remembered_messages(publisher: aib.Publisher) -> None:
    """forget(name) drops the message last got as name, forget() all of them: the next get is
    imported by Python again (and remembered again). A closed session refuses; a bad pool_linger
    is refused up front."""
    counts = SessionCounts()
    publisher.publish("a", null_batch(2, 10))
    publisher.publish("b", null_batch(3, 10))
    with aib.connect(publisher.path, timeout=5.0) as session:
        for name in ("a", "b", "a", "b"):
            session.get(name).release()
        assert counts.remembered_gets == 2
        assert session.forget("a") == 1
        assert session.forget("a") == 0  # nothing remembered under that name any more
        assert session.forget("nobody") == 0
        session.get("b").release()
        assert counts.remembered_gets == 3
        session.get("a").release()  # decoded again
        assert counts.remembered_gets == 3
        session.get("a").release()
        assert counts.remembered_gets == 4
        assert session.forget() == 2
        session.get("b").release()
        assert counts.remembered_gets == 4
    with pytest.raises(aib.BridgeError, match="closed"):
        session.forget()
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="pool_linger"):
            aib.Session(pool_linger=bad)


def test_remembered_messages_bounds_the_steady_state(publisher: aib.Publisher) -> None:
    """remembered_messages is how many names' messages re-gets find remembered: three names got in
    a cycle all hit with room for three, all miss with room for two (least recently used out
    first), and nothing is remembered with 0. Anything but an int >= 0 is refused up front."""
    counts = SessionCounts()
    for rows, name in enumerate(("a", "b", "c"), start=10):
        publisher.publish(name, null_batch(2, rows))  # three different messages
    for room, hits in ((3, 3), (2, 0), (0, 0)):
        with aib.connect(publisher.path, timeout=5.0, remembered_messages=room) as session:
            counts.reset()  # this session's gets
            for name in ("a", "b", "c", "a", "b", "c"):
                session.get(name).release()
            assert counts.remembered_gets == hits, room
            assert len(session._remembered) == min(room, 3)
    with pytest.raises(ValueError, match="remembered_messages"):
        aib.Session(remembered_messages=-1)
    for bad in (1.5, True, "8"):  # not an int: a TypeError
        with pytest.raises(TypeError, match="remembered_messages"):
            aib.Session(remembered_messages=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pool_linger", "session_fds"), [(0, 2), (1.0, 3)], ids=["every-get-asks", "default"]
)
def test_host_messages_are_remembered_by_bytes_and_files(
    publisher: aib.Publisher, pool_linger: float, session_fds: int
) -> None:
    """A host table's re-gets are imported by the C core (the descriptors that come with the answer are
    the files the remembered message mapped: closed, nothing leaks). The same bytes with other files
    (another table of the same shape) take the Python path and read their own data, and the name's old
    message is dropped. With ``pool_linger=0`` every get is answered by the publisher (its descriptors
    closed here); by default the re-gets after the second are local and bring no descriptors, and the
    session holds its version board's page open too."""
    counts = SessionCounts()
    a = pa.record_batch({"x": pa.array([1, 2, 3]), "s": pa.array(["a", None, "c"])})
    b = pa.record_batch({"x": pa.array([4, 5, 6]), "s": pa.array(["d", None, "f"])})
    assert aib.export(a).message == aib.export(b).message  # same shape, same bytes: only the files differ
    publisher.publish("t", a)
    base_fds = fd_count()
    with aib.connect(publisher.path, timeout=5.0, pool_linger=pool_linger) as session:
        for _ in range(50):
            with session.get("t") as imported:
                assert pa.record_batch(imported).equals(a)
        assert counts.remembered_gets == 49
        assert counts.local_gets == (0 if pool_linger == 0 else 48)
        # the session's socket and template file (and, by default, its board)
        assert wait_for(lambda: fd_count() <= base_fds + session_fds, 2.0)
        publisher.publish("t", b)
        with session.get("t") as imported:
            assert pa.record_batch(imported).equals(b)
        assert counts.remembered_gets == 49
        assert len(session._remembered) == 1  # a's message went when the name got b
        with session.get("t") as imported:
            assert pa.record_batch(imported).equals(b)
        assert counts.remembered_gets == 50
        # import_message checks the files the same way
        exported_a, exported_b = aib.export(a), aib.export(b)
        try:
            for exported, expected in ((exported_a, a), (exported_b, b), (exported_a, a)):
                with session.import_message(exported.message, exported.fds) as imported:
                    assert pa.record_batch(imported).equals(expected)
        finally:
            exported_a.close()
            exported_b.close()
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_remembered_messages_churn_across_threads(publisher: aib.Publisher) -> None:
    """More distinct messages than the session remembers, fetched by four threads of one session: every
    get returns the right data, the C mirror never holds more than the limit, and nothing leaks."""
    counts = SessionCounts()
    batches = {f"n{k}": null_batch(3, 10 + k) for k in range(5)}
    for name, batch in batches.items():
        publisher.publish(name, batch)
    with aib.connect(publisher.path, timeout=10.0) as session:
        session._remembered.limit = 2
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                for i in range(60):
                    name = f"n{(seed + i * (seed + 1)) % 5}"
                    with session.get(name) as imported:
                        assert pa.record_batch(imported).equals(batches[name])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        assert errors == []
        assert lib.aib_remembered_count(session._remembered.table) <= 2
        assert counts.remembered_gets > 0
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_remembered_bytes_with_a_descriptor_take_the_checked_path(sock_dir: str) -> None:
    """A publisher that sends a remembered message again but with a descriptor attached: the C core does
    not import it (only descriptor-free answers are), the Python path does and closes the descriptor."""
    counts = SessionCounts()
    message = aib.export(null_batch(2, 5)).message
    r, w = os.pipe()
    try:
        replies: list[tuple[int, bytes, list[int]] | None] = [
            (protocol.ITEM, encode_item(1, message), []),
            (protocol.ITEM, encode_item(2, message), []),
            (protocol.ITEM, encode_item(3, message), [r]),
        ]
        fake = FakePublisher(os.path.join(sock_dir, "f.sock"), replies=replies)
        with fake, aib.connect(fake.path, timeout=5.0) as session:
            for lease in (1, 2, 3):
                with session.get("x") as imported:
                    assert pa.record_batch(imported).num_rows == 5
                assert fake.releases.get(timeout=5.0) == lease
            assert counts.remembered_gets == 1
    finally:
        os.close(r)
        os.close(w)


def test_c_side_gets_keep_the_least_recently_used_order(publisher: aib.Publisher) -> None:
    """The set's LRU order is kept where the steady-state gets happen (the C core): with room for two,
    a name re-got by the C path since the last remember stays, and the one not got since goes; lowering
    the limit forgets the least recently used at once."""
    counts = SessionCounts()
    for rows, name in enumerate(("a", "b", "c"), start=10):
        publisher.publish(name, null_batch(2, rows))
    with aib.connect(publisher.path, timeout=5.0, remembered_messages=2) as session:
        for name in ("a", "b", "a", "c"):  # the third get of a is a C-side hit: a is newer than b
            session.get(name).release()
        assert counts.remembered_gets == 1
        session.get("a").release()  # still remembered: c pushed b out
        assert counts.remembered_gets == 2
        session.get("b").release()  # decoded again (and remembered, pushing c out)
        assert counts.remembered_gets == 2
        session._remembered.limit = 1  # keeps b, the most recently used
        assert len(session._remembered) == 1
        session.get("b").release()
        assert counts.remembered_gets == 3
        session.get("a").release()
        assert counts.remembered_gets == 3
    assert wait_for(lambda: publisher.active_leases == 0, 2.0)


def test_the_set_gives_back_kept_leases_unused_for_the_linger_time() -> None:
    """The C set itself (aib_remembered): a message put as holding a kept lease (lingers) is let go
    of once no get used it for the linger time, one without stays; a name keeps one message (its
    next one replaces it); everything let go of is handed back by id, once."""
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.metadata import Decoded

    table = ffi.gc(lib.aib_remembered_new(8), lib.aib_remembered_free)
    templates = [Decoded(aib.export(null_batch(1, rows)).message, 0) for rows in (1, 2, 3)]
    ids = []
    try:
        for template, name, lingers in zip(templates, (b"kept", b"plain", b"kept"), (1, 0, 1), strict=True):
            entry_id = ffi.new("uint64_t *")
            message = template.message
            assert (
                lib.aib_remembered_put(
                    table, message, len(message), template.owner, 0, ffi.NULL, 0,
                    lib.AIB_REMEMBERED_ANY_FDS, name, len(name), lingers, entry_id,
                )
                == 0
            )  # fmt: skip
            ids.append(entry_id[0])
        # The third message took the name "kept" from the first.
        assert lib.aib_remembered_take_forgotten(table) == ids[0]
        assert lib.aib_remembered_take_forgotten(table) == 0
        assert lib.aib_remembered_count(table) == 2
        event = ffi.new("uint64_t *")
        third = templates[2].message
        assert lib.aib_remembered_find(table, third, len(third), ffi.NULL, 0, event) == ids[2]
        now = time.monotonic()
        deadline = lib.aib_remembered_expire(table, now, 60.0)
        assert now < deadline <= now + 60.0  # not expired yet: its deadline comes back
        assert lib.aib_remembered_take_forgotten(table) == 0
        assert lib.aib_remembered_expire(table, now + 61.0, 60.0) == -1.0  # no kept lease left
        assert lib.aib_remembered_take_forgotten(table) == ids[2]
        assert lib.aib_remembered_take_forgotten(table) == 0
        assert lib.aib_remembered_count(table) == 1  # the plain one stays
        assert lib.aib_remembered_forget_name(table, b"plain", 5, ffi.NULL, 0) == 1
        assert lib.aib_remembered_take_forgotten(table) == ids[1]
    finally:
        ffi.release(table)
        for template in templates:
            template.close()


def test_the_set_grows_past_its_first_buckets_and_keeps_its_order() -> None:
    """The C set holds more messages than it first made room for (its table grows), finds every
    one, and a lower limit lets go of the least recently used first, oldest first."""
    from arrow_ipc_bridge._ffi import ffi
    from arrow_ipc_bridge.wire.metadata import Decoded

    table = ffi.gc(lib.aib_remembered_new(8), lib.aib_remembered_free)  # room made for 8
    lib.aib_remembered_set_limit(table, 1000)
    templates = [Decoded(aib.export(null_batch(1, rows)).message, 0) for rows in range(1, 301)]
    ids = []
    event = ffi.new("uint64_t *")
    try:
        for i, template in enumerate(templates):
            entry_id = ffi.new("uint64_t *")
            message, name = template.message, f"n{i}".encode()
            assert (
                lib.aib_remembered_put(
                    table, message, len(message), template.owner, i, ffi.NULL, 0,
                    lib.AIB_REMEMBERED_ANY_FDS, name, len(name), 0, entry_id,
                )
                == 0
            )  # fmt: skip
            ids.append(entry_id[0])
        assert lib.aib_remembered_count(table) == 300
        for i, template in enumerate(templates):
            message = template.message
            assert lib.aib_remembered_find(table, message, len(message), ffi.NULL, 0, event) == ids[i]
            assert event[0] == i
        for i in (150, 7):  # names are found after the growth too
            assert lib.aib_remembered_forget_name(table, f"n{i}".encode(), len(f"n{i}"), ffi.NULL, 0) == 1
            assert lib.aib_remembered_take_forgotten(table) == ids[i]
        first = templates[0].message
        assert lib.aib_remembered_find(table, first, len(first), ffi.NULL, 0, event) == ids[0]  # newest now
        lib.aib_remembered_set_limit(table, 10)
        forgotten = []
        while entry_id := lib.aib_remembered_take_forgotten(table):
            forgotten.append(entry_id)
        gone = {ids[7], ids[150]}
        assert sorted(forgotten) == sorted(set(ids[1:291]) - gone)  # the 288 least recently used
        kept = [ids[0], *ids[291:]]
        for i, template in enumerate(templates):
            message = template.message
            found = lib.aib_remembered_find(table, message, len(message), ffi.NULL, 0, event)
            assert found == (ids[i] if ids[i] in kept else 0)
    finally:
        ffi.release(table)
        for template in templates:
            template.close()
