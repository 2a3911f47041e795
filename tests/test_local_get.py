"""Local re-gets: a standing-lease session's gets that the publisher's version board answers with no
round trip, made in one builtin call by the C core's local getter (``cffi_build/py_local_get.c``),
return the same data, version and name as a round trip and objects indistinguishable from
``Session._get_now``'s, are counted in ``aib.stats().session.local_gets``, are released by
``Session.close``, and are never made after a close, in a forked child, for a bad name, or once the
board shows another publication. docs/lifetime.md ("Standing leases") describes the path.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): descriptors, the C core's live
owners, struct nodes and mappings, the reaper's pending callbacks and threads return to what they
were before the test.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers.session_rig import report_from_forked_child, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.consumer.remembered import RememberedMessage
from arrow_ipc_bridge.errors import ClosedError, InvalidArgumentError, NotPublishedError
from arrow_ipc_bridge.runtime import reaper

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture
def local_session(publisher: aib.Publisher) -> Iterator[aib.Session]:
    """A standing-lease session whose gets of "t" (a record batch) and "s" (a table) are local."""
    publisher.publish("t", pa.record_batch({"x": pa.array([1, 2, 3], pa.int64())}))
    publisher.publish("s", pa.table({"y": ["a", None, "c"]}))
    with aib.connect(publisher.path, timeout=10.0) as session:
        for _ in range(2):  # the first get imports, the second takes the standing lease
            for name in ("t", "s"):
                session.get(name).release()
        yield session


def local_gets() -> int:
    """Local gets made by this process so far."""
    return aib.stats().session.local_gets


def test_local_gets_have_the_data_and_the_counts(
    local_session: aib.Session, publisher: aib.Publisher
) -> None:
    """Each later get is local: the data, the version and the name, and the process's counters."""
    before = aib.stats().session
    for round_ in range(1, 4):
        with local_session.get("t") as batch, local_session.get("s") as table:
            assert isinstance(batch, aib.ImportedArray)
            assert isinstance(table, aib.ImportedStream)
            assert pa.record_batch(batch).column(0).to_pylist() == [1, 2, 3]
            assert pa.table(table).column("y").to_pylist() == ["a", None, "c"]
            assert (batch.version, table.version) == (publisher.version("t"), publisher.version("s"))
            assert batch.name == "t"
            assert table.name == "s"
        assert aib.stats().session.local_gets - before.local_gets == 2 * round_
    after = aib.stats().session
    assert after.local_gets - before.local_gets == 6
    assert after.remembered_gets - before.remembered_gets == 6


def test_a_c_made_import_has_the_python_paths_attributes(local_session: aib.Session) -> None:
    """The getter's objects carry the same attributes as those the Python path makes for the same
    local answer (with the getter set aside), so no code can tell them apart."""

    def state(obj: Any) -> dict[str, Any]:
        """Every attribute the object holds: the slots of its C base type (the getter fills them
        by offset; an unset one reads as None) and anything in its __dict__."""
        slots = {
            name: getattr(obj, name)
            for klass in type(obj).__mro__
            for name, value in vars(klass).items()
            if isinstance(value, types.MemberDescriptorType)
        }
        return {**slots, **getattr(obj, "__dict__", {})}

    def attributes(imported: Any) -> dict[str, Any]:
        fields = state(imported)
        decoded = fields.pop("_decoded")
        fields["decoded"] = {k: v for k, v in state(decoded).items() if k != "owner"}
        fields["owner type"] = ffi.typeof(decoded.owner)
        # Each import's own owner, and its slot for the producer's event (none for host data).
        assert fields.pop("_owner_address") == int(ffi.cast("uintptr_t", decoded.owner))
        fields["has sync"] = fields.pop("_sync") != ffi.NULL
        return fields

    with local_session.get("t") as from_c:
        c_fields = attributes(from_c)
    getter_get, local_session._local_get = local_session._local_get, None
    try:
        with local_session.get("t") as from_python:
            python_fields = attributes(from_python)
    finally:
        local_session._local_get = getter_get
    assert local_session._local_getter.gets == 1
    assert c_fields.keys() == python_fields.keys()
    assert {"_bases", "_n_bases", "_device_type", "name", "version"} <= c_fields.keys()
    assert {"_d", "_message", "_reader_maps"} <= c_fields["decoded"].keys()
    assert c_fields["version"] is not None  # a board answer carries the version
    assert c_fields == python_fields


def test_a_get_waiting_for_the_request_lock_answers_nothing_once_closed(local_session: aib.Session) -> None:
    """A get that waited for the request lock while the session closed (close marks the getter
    first, then tears down under that lock) answers nothing: it looks again once it holds the lock."""
    getter = local_session._local_getter
    answers: list[object] = []
    with local_session._request_lock:
        thread = threading.Thread(target=lambda: answers.append(getter.get("t")))
        thread.start()
        thread.join(0.2)
        assert thread.is_alive()  # held up by the request lock
        getter.close()
    thread.join(10)
    assert answers == [None]
    assert getter.gets == 0


def test_closing_the_session_releases_local_imports(local_session: aib.Session) -> None:
    """Session.close releases what local gets handed out; a get after it raises ClosedError and
    answers nothing from the board."""
    before = local_gets()
    held = [local_session.get("t"), local_session.get("s")]
    assert local_gets() - before == 2
    local_session.close()
    assert all(imported.released for imported in held)
    with pytest.raises(ClosedError):
        local_session.get("t")
    assert local_gets() - before == 2


def test_a_collected_local_import_leaves_the_sessions_set(local_session: aib.Session) -> None:
    """The session's set of live imports holds weak references that leave it when their import dies
    (a consumer that never calls release leaks nothing)."""
    before = len(local_session._imported)
    gets_before = local_gets()
    imports = [local_session.get("t") for _ in range(50)]
    assert local_gets() - gets_before == 50
    assert len(local_session._imported) == before + 50
    del imports
    gc.collect()
    reaper.settle()
    assert len(local_session._imported) == before


@pytest.mark.parametrize(
    ("name", "error"),
    [
        (7, InvalidArgumentError),
        ("", InvalidArgumentError),
        ("\ud800", InvalidArgumentError),
        ("x" * 5000, InvalidArgumentError),
    ],
)
def test_a_bad_name_is_refused_before_the_board_is_read(
    local_session: aib.Session, name: Any, error: type
) -> None:
    """Not a str, or not a name: the documented argument error, and no local get."""
    before = local_gets()
    with pytest.raises(error):
        local_session.get(name)
    assert local_gets() == before


def test_an_unknown_or_republished_name_is_asked_of_the_publisher(
    local_session: aib.Session, publisher: aib.Publisher
) -> None:
    """A name with no standing lease goes to the publisher (NotPublishedError); after a new publish
    the board no longer matches and the get is a round trip that returns the new data."""
    before = local_gets()
    with pytest.raises(NotPublishedError):
        local_session.get("nothing")
    publisher.publish("t", pa.record_batch({"x": pa.array([9], pa.int64())}))
    with local_session.get("t") as imported:
        assert pa.record_batch(imported).column(0).to_pylist() == [9]
    assert local_gets() == before


def test_gets_from_several_threads_are_each_whole(local_session: aib.Session) -> None:
    """Threads getting at once (each get holds the session's request lock) each get whole imports,
    and every lease ends."""
    before = local_gets()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(200):
                with local_session.get("t") as imported:
                    assert pa.record_batch(imported).num_rows == 3
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert local_gets() - before == 800


def test_a_closed_publisher_is_a_clear_error_not_a_local_answer(
    local_session: aib.Session, publisher: aib.Publisher
) -> None:
    """When the publisher closes, its end of the connection is unread on the channel: no local
    answer, the get raises PeerClosedError."""
    before = local_gets()
    publisher.close()
    assert wait_for(lambda: not local_session._connection().quiet(), 5.0)
    with pytest.raises(aib.PeerClosedError):
        local_session.get("t")
    assert local_gets() == before


def _forked_child(session: aib.Session) -> list[Any]:
    report: list[Any] = []
    try:
        session.get("t")
        report.append("no error")
    except aib.ClosedError:
        report.append("foreign")
    session.close()
    return report


def test_a_forked_child_gets_nothing_from_its_parents_board(local_session: aib.Session) -> None:
    """A child of fork inherits the session: a get there raises ClosedError; the parent's
    gets go on locally."""
    report = report_from_forked_child(lambda: _forked_child(local_session))
    assert report == ["foreign"]
    before = local_gets()
    with local_session.get("t") as imported:
        assert pa.record_batch(imported).num_rows == 3
    assert local_gets() - before == 1


def test_a_session_without_standing_leases_makes_no_local_get(publisher: aib.Publisher) -> None:
    """Without standing leases (``pool_linger=0``) every get asks the publisher."""
    publisher.publish("t", pa.table({"x": [1]}))
    before = local_gets()
    with aib.connect(publisher.path, timeout=10.0, pool_linger=0) as plain:
        for _ in range(3):
            with plain.get("t") as imported:
                assert pa.table(imported).num_rows == 1
    assert local_gets() == before


def test_a_closed_channel_answers_nothing_locally(local_session: aib.Session) -> None:
    """The channel's closed state is the C channel's own: once the channel is closed, the getter
    answers nothing (the board still shows the publication) and the get raises the session's
    error."""
    channel = local_session._connection()
    getter = local_session._local_getter
    before = local_gets()
    channel.close()
    assert channel.closed
    assert getter.get("t") is None
    with pytest.raises(aib.PeerClosedError):
        local_session.get("t")
    assert local_gets() == before
    assert getter.gets == 0


def test_local_imports_are_ordinary_objects(local_session: aib.Session) -> None:
    """What the getter makes behaves as the Python classes' objects did before their state moved
    into C slots: weak references, attributes of one's own, copy.copy (the same state), and a
    clear TypeError from pickle (its cffi pointers cannot travel)."""
    with local_session.get("t") as imported:
        assert weakref.ref(imported)() is imported
        imported.note = "mine"
        twin = copy.copy(imported)
        assert type(twin) is type(imported)
        assert (twin._decoded, twin._bases, twin.name, twin.version, twin.note) == (
            imported._decoded,
            imported._bases,
            "t",
            imported.version,
            "mine",
        )
        with pytest.raises(TypeError, match="pickle"):
            pickle.dumps(imported)
        del twin


def test_a_cycle_through_the_c_slots_is_collected(local_session: aib.Session) -> None:
    """An import referring to itself through a slot of its C base type is found by the garbage
    collector (the base type traverses its slots) and its lease ends."""
    imported = local_session.get("t")
    imported.publisher_id = imported  # any object fits a slot: a cycle through C-owned state
    alive = weakref.ref(imported)
    del imported
    gc.collect()
    reaper.settle()
    assert alive() is None


def test_a_remembered_message_takes_only_a_decode_and_an_imported_class(local_session: aib.Session) -> None:
    """The getter reads a remembered message's slots without looking: its constructor refuses a
    template that is not a Decoded and a class that is not an imported one."""
    remembered = next(iter(local_session._remembered._by_id.values()))
    args = {
        "template": remembered.template,
        "bases": remembered.bases,
        "device_type": remembered.device_type,
        "device_id": remembered.device_id,
        "imported_type": remembered.imported_type,
        "mapped_on": None,
    }
    again = RememberedMessage(**args)
    assert (again.n_bases, again.imported_type) == (len(remembered.bases), remembered.imported_type)
    with pytest.raises(TypeError, match="template must be a Decoded"):
        RememberedMessage(**{**args, "template": object()})
    with pytest.raises(TypeError, match="imported_type must be an imported class"):
        RememberedMessage(**{**args, "imported_type": dict})
    with pytest.raises(AttributeError):
        again.bases = None  # type: ignore[misc]
    with pytest.raises(TypeError, match="adopt takes 4 arguments"):
        again.adopt(remembered.template.owner)  # type: ignore[call-arg]
