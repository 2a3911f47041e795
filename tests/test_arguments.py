"""Arguments checked at the API boundary: every public function, every kind of bad input.

Each row calls one public function with one bad argument and names the exception class it must
raise, exactly (``InvalidArgumentError`` for a wrong type, ``InvalidArgumentError`` for a value not
allowed), and the argument the error must name: in ``exc.argument`` and at the start of the message,
which goes on to say what is allowed. Rows that would change state (publish, open a stream) are
followed by a check that nothing changed. A second table holds values at the edges that must be
accepted (NumPy scalars, ``os.PathLike``, ``bytearray``, zero), so that the checks are not stricter
than the documentation.
"""

from __future__ import annotations

import math
import os
import pathlib
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.errors import InvalidArgumentError
from arrow_ipc_bridge.transport import protocol

TYPE = InvalidArgumentError
VALUE = InvalidArgumentError


@dataclass
class Rig:
    """One publisher with a published batch and an open stream, a session connected to it with that
    batch imported, and a subscription: the objects whose methods the rows call."""

    sock_dir: str
    pub: aib.Publisher
    session: aib.Session
    imported: aib.ImportedArray
    writer: aib.StreamWriter
    live: aib.LiveStream
    exported: aib.Exported

    def path(self, name: str) -> str:
        return os.path.join(self.sock_dir, name)


BATCH = pa.record_batch({"x": pa.array([1, 2, 3], pa.int64()), "y": pa.array([1.0, 2.0, 3.0])})


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    sock_dir = str(tmp_path_factory.mktemp("args"))
    with aib.Publisher(os.path.join(sock_dir, "p.sock")) as pub:
        pub.publish("b", BATCH)
        writer = pub.open_stream("s")
        with aib.connect(pub.path) as session:
            imported = session.get("b")
            live = session.subscribe("s", timeout=5.0)
            exported = aib.export(BATCH)
            try:
                yield Rig(sock_dir, pub, session, imported, writer, live, exported)
            finally:
                exported.close()
                live.close()
                imported.release()
                writer.close()


def layout(**fields: Any) -> aib.SlotLayout:
    values: dict[str, Any] = {"schema": pa.schema([("x", pa.int64())]), "rows": 4}
    values.update(fields)
    return aib.SlotLayout(**values)


Call = Callable[[Rig], object]
# (row id, the call, the exception class, the argument it names)
ROWS: list[tuple[str, Call, type[Exception], str]] = [
    # ---- Publisher(...) ----
    ("Publisher path int", lambda r: aib.Publisher(5), TYPE, "path"),  # type: ignore[arg-type]
    ("Publisher path bytes", lambda r: aib.Publisher(b"/tmp/x.sock"), TYPE, "path"),  # type: ignore[arg-type]
    ("Publisher path empty", lambda r: aib.Publisher(""), VALUE, "path"),
    ("Publisher path NUL", lambda r: aib.Publisher(r.path("a\0b")), VALUE, "path"),
    (
        "Publisher allowed_uids str",
        lambda r: aib.Publisher(r.path("u"), allowed_uids="1000"),
        TYPE,
        "allowed_uids",
    ),  # type: ignore[arg-type]
    (
        "Publisher allowed_uids int",
        lambda r: aib.Publisher(r.path("u"), allowed_uids=1000),
        TYPE,
        "allowed_uids",
    ),  # type: ignore[arg-type]
    (
        "Publisher allowed_uids negative",
        lambda r: aib.Publisher(r.path("u"), allowed_uids=[-1]),
        VALUE,
        "allowed_uids",
    ),
    (
        "Publisher allowed_uids float",
        lambda r: aib.Publisher(r.path("u"), allowed_uids=[1.0]),
        TYPE,
        "allowed_uids",
    ),  # type: ignore[list-item]
    ("Publisher copy bogus", lambda r: aib.Publisher(r.path("c"), copy="bogus"), VALUE, "copy"),  # type: ignore[arg-type]
    ("Publisher copy None", lambda r: aib.Publisher(r.path("c"), copy=None), TYPE, "copy"),  # type: ignore[arg-type]
    (
        "Publisher max_connections 0",
        lambda r: aib.Publisher(r.path("m"), max_connections=0),
        VALUE,
        "max_connections",
    ),
    (
        "Publisher max_connections float",
        lambda r: aib.Publisher(r.path("m"), max_connections=2.0),
        TYPE,
        "max_connections",
    ),  # type: ignore[arg-type]
    (
        "Publisher max_connections str",
        lambda r: aib.Publisher(r.path("m"), max_connections="5"),
        TYPE,
        "max_connections",
    ),  # type: ignore[arg-type]
    (
        "Publisher handshake_timeout 0",
        lambda r: aib.Publisher(r.path("h"), handshake_timeout=0),
        VALUE,
        "handshake_timeout",
    ),
    (
        "Publisher handshake_timeout NaN",
        lambda r: aib.Publisher(r.path("h"), handshake_timeout=math.nan),
        VALUE,
        "handshake_timeout",
    ),
    (
        "Publisher handshake_timeout inf",
        lambda r: aib.Publisher(r.path("h"), handshake_timeout=math.inf),
        VALUE,
        "handshake_timeout",
    ),
    (
        "Publisher handshake_timeout bool",
        lambda r: aib.Publisher(r.path("h"), handshake_timeout=True),
        TYPE,
        "handshake_timeout",
    ),
    (
        "Publisher handshake_timeout str",
        lambda r: aib.Publisher(r.path("h"), handshake_timeout="1"),
        TYPE,
        "handshake_timeout",
    ),  # type: ignore[arg-type]
    (
        "Publisher max_leases 0",
        lambda r: aib.Publisher(r.path("l"), max_leases_per_connection=0),
        VALUE,
        "max_leases_per_connection",
    ),
    (
        "Publisher max_leases float",
        lambda r: aib.Publisher(r.path("l"), max_leases_per_connection=1.5),
        TYPE,
        "max_leases_per_connection",
    ),  # type: ignore[arg-type]
    (
        "Publisher max_unread_fds small",
        lambda r: aib.Publisher(r.path("f"), max_unread_fds=10),
        VALUE,
        "max_unread_fds",
    ),
    (
        "Publisher park_after negative",
        lambda r: aib.Publisher(r.path("k"), park_after=-1),
        VALUE,
        "park_after",
    ),
    ("Publisher park_after None", lambda r: aib.Publisher(r.path("k"), park_after=None), TYPE, "park_after"),  # type: ignore[arg-type]
    (
        "Publisher max_subscriptions 0",
        lambda r: aib.Publisher(r.path("s"), max_subscriptions=0),
        VALUE,
        "max_subscriptions",
    ),
    (
        "Publisher max_subscriptions bool",
        lambda r: aib.Publisher(r.path("s"), max_subscriptions=True),
        TYPE,
        "max_subscriptions",
    ),
    # ---- Publisher methods ----
    ("publish name int", lambda r: r.pub.publish(1, BATCH), TYPE, "name"),  # type: ignore[arg-type]
    ("publish name bytes", lambda r: r.pub.publish(b"b", BATCH), TYPE, "name"),  # type: ignore[arg-type]
    ("publish name empty", lambda r: r.pub.publish("", BATCH), VALUE, "name"),
    ("publish name too long", lambda r: r.pub.publish("n" * (protocol.MAX_NAME + 1), BATCH), VALUE, "name"),
    ("publish name surrogate", lambda r: r.pub.publish("a\ud800", BATCH), VALUE, "name"),
    ("publish copy bogus", lambda r: r.pub.publish("b", BATCH, copy="bogus"), VALUE, "copy"),  # type: ignore[arg-type]
    ("publish copy empty", lambda r: r.pub.publish("b", BATCH, copy=""), VALUE, "copy"),  # type: ignore[arg-type]
    ("publish copy int", lambda r: r.pub.publish("b", BATCH, copy=1), TYPE, "copy"),  # type: ignore[arg-type]
    ("unpublish name int", lambda r: r.pub.unpublish(1), TYPE, "name"),  # type: ignore[arg-type]
    ("version name float", lambda r: r.pub.version(1.0), TYPE, "name"),  # type: ignore[arg-type]
    ("open_stream name int", lambda r: r.pub.open_stream(3), TYPE, "name"),  # type: ignore[arg-type]
    (
        "open_stream max_in_flight 0",
        lambda r: r.pub.open_stream("o", max_in_flight=0),
        VALUE,
        "max_in_flight",
    ),
    (
        "open_stream max_in_flight str",
        lambda r: r.pub.open_stream("o", max_in_flight="8"),
        TYPE,
        "max_in_flight",
    ),  # type: ignore[arg-type]
    ("open_stream on_slow bogus", lambda r: r.pub.open_stream("o", on_slow="later"), VALUE, "on_slow"),
    ("open_stream on_slow int", lambda r: r.pub.open_stream("o", on_slow=1), TYPE, "on_slow"),  # type: ignore[arg-type]
    (
        "open_stream block_timeout negative",
        lambda r: r.pub.open_stream("o", block_timeout=-1),
        VALUE,
        "block_timeout",
    ),
    (
        "open_stream block_timeout str",
        lambda r: r.pub.open_stream("o", block_timeout="1"),
        TYPE,
        "block_timeout",
    ),  # type: ignore[arg-type]
    ("open_stream slots object", lambda r: r.pub.open_stream("o", slots=object()), TYPE, "slots"),  # type: ignore[arg-type]
    ("open_stream copy bogus", lambda r: r.pub.open_stream("o", copy="maybe"), VALUE, "copy"),  # type: ignore[arg-type]
    (
        "SlotLayout schema",
        lambda r: r.pub.open_stream("o", slots=layout(schema="x")),
        TYPE,
        "SlotLayout.schema",
    ),
    (
        "SlotLayout schema string column",
        lambda r: r.pub.open_stream("o", slots=layout(schema=pa.schema([("s", pa.string())]))),
        VALUE,
        "SlotLayout.schema",
    ),
    ("SlotLayout rows 0", lambda r: r.pub.open_stream("o", slots=layout(rows=0)), VALUE, "SlotLayout.rows"),
    (
        "SlotLayout rows str",
        lambda r: r.pub.open_stream("o", slots=layout(rows="4")),
        TYPE,
        "SlotLayout.rows",
    ),
    (
        "SlotLayout count 0",
        lambda r: r.pub.open_stream("o", slots=layout(count=0)),
        VALUE,
        "SlotLayout.count",
    ),
    (
        "SlotLayout device",
        lambda r: r.pub.open_stream("o", slots=layout(device="gpu")),
        VALUE,
        "SlotLayout.device",
    ),
    (
        "SlotLayout device_id",
        lambda r: r.pub.open_stream("o", slots=layout(device_id=-1)),
        VALUE,
        "SlotLayout.device_id",
    ),
    ("publish_stream source int", lambda r: r.pub.publish_stream("o", 5), TYPE, "source"),
    ("publish_stream source str", lambda r: r.pub.publish_stream("o", "abc"), TYPE, "source"),
    (
        "publish_stream wait_for_subscribers negative",
        lambda r: r.pub.publish_stream("o", [BATCH], wait_for_subscribers=-1),
        VALUE,
        "wait_for_subscribers",
    ),
    (
        "publish_stream wait_for_subscribers float",
        lambda r: r.pub.publish_stream("o", [BATCH], wait_for_subscribers=1.0),
        TYPE,
        "wait_for_subscribers",
    ),  # type: ignore[arg-type]
    ("Publisher.close timeout str", lambda r: r.pub.close(timeout="5"), TYPE, "timeout"),  # type: ignore[arg-type]
    ("Publisher.close timeout negative", lambda r: r.pub.close(timeout=-1), VALUE, "timeout"),
    # ---- StreamWriter, LiveStream ----
    ("reserve timeout str", lambda r: r.writer.reserve(timeout="1"), TYPE, "timeout"),  # type: ignore[arg-type]
    ("reserve timeout NaN", lambda r: r.writer.reserve(timeout=math.nan), VALUE, "timeout"),
    ("fail error int", lambda r: r.writer.fail(5), TYPE, "error"),  # type: ignore[arg-type]
    ("next_batch timeout str", lambda r: r.live.next_batch(timeout="1"), TYPE, "timeout"),  # type: ignore[arg-type]
    ("next_batch timeout negative", lambda r: r.live.next_batch(timeout=-1.0), VALUE, "timeout"),
    # ---- connect, Session ----
    ("connect path int", lambda r: aib.connect(5), TYPE, "path"),  # type: ignore[arg-type]
    ("connect path empty", lambda r: aib.connect(""), VALUE, "path"),
    ("connect timeout str", lambda r: aib.connect(r.pub.path, timeout="5"), TYPE, "timeout"),  # type: ignore[arg-type]
    ("connect timeout None", lambda r: aib.connect(r.pub.path, timeout=None), TYPE, "timeout"),  # type: ignore[arg-type]
    ("connect timeout bool", lambda r: aib.connect(r.pub.path, timeout=True), TYPE, "timeout"),
    ("connect timeout negative", lambda r: aib.connect(r.pub.path, timeout=-1), VALUE, "timeout"),
    ("connect timeout NaN", lambda r: aib.connect(r.pub.path, timeout=math.nan), VALUE, "timeout"),
    ("connect timeout inf", lambda r: aib.connect(r.pub.path, timeout=math.inf), VALUE, "timeout"),
    (
        "connect wait_for_publisher int",
        lambda r: aib.connect(r.pub.path, wait_for_publisher=1),
        TYPE,
        "wait_for_publisher",
    ),  # type: ignore[arg-type]
    ("connect pool_linger negative", lambda r: aib.connect(r.pub.path, pool_linger=-1), VALUE, "pool_linger"),
    ("connect pool_linger str", lambda r: aib.connect(r.pub.path, pool_linger="1"), TYPE, "pool_linger"),  # type: ignore[arg-type]
    (
        "connect remembered_messages negative",
        lambda r: aib.connect(r.pub.path, remembered_messages=-1),
        VALUE,
        "remembered_messages",
    ),
    (
        "connect remembered_messages float",
        lambda r: aib.connect(r.pub.path, remembered_messages=1.5),
        TYPE,
        "remembered_messages",
    ),  # type: ignore[arg-type]
    ("connect check bogus", lambda r: aib.connect(r.pub.path, check="Full"), VALUE, "check"),
    ("connect check int", lambda r: aib.connect(r.pub.path, check=2), TYPE, "check"),  # type: ignore[arg-type]
    (
        "Session mapping_cache_size negative",
        lambda r: aib.Session(mapping_cache_size=-1),
        VALUE,
        "mapping_cache_size",
    ),
    (
        "Session mapping_cache_size str",
        lambda r: aib.Session(mapping_cache_size="3"),
        TYPE,
        "mapping_cache_size",
    ),  # type: ignore[arg-type]
    ("Session pool_linger NaN", lambda r: aib.Session(pool_linger=math.nan), VALUE, "pool_linger"),
    ("import_message message str", lambda r: r.session.import_message("abc"), TYPE, "message"),  # type: ignore[arg-type]
    ("import_message message None", lambda r: r.session.import_message(None), TYPE, "message"),  # type: ignore[arg-type]
    ("import_message fds int", lambda r: r.session.import_message(r.exported.message, 5), TYPE, "fds"),  # type: ignore[arg-type]
    ("import_message fds of str", lambda r: r.session.import_message(r.exported.message, ["3"]), TYPE, "fds"),  # type: ignore[list-item]
    (
        "import_message name int",
        lambda r: r.session.import_message(r.exported.message, r.exported.fds, name=1),
        TYPE,
        "name",
    ),  # type: ignore[arg-type]
    ("get name int", lambda r: r.session.get(1), TYPE, "name"),  # type: ignore[arg-type]
    ("get name empty", lambda r: r.session.get(""), VALUE, "name"),
    ("get wait str", lambda r: r.session.get("b", wait="1"), TYPE, "wait"),  # type: ignore[arg-type]
    ("get wait negative", lambda r: r.session.get("b", wait=-1), VALUE, "wait"),
    ("get wait NaN", lambda r: r.session.get("b", wait=math.nan), VALUE, "wait"),
    ("get_next after negative", lambda r: r.session.get_next("b", after=-1, timeout=1), VALUE, "after"),
    ("get_next after float", lambda r: r.session.get_next("b", after=1.5, timeout=1), TYPE, "after"),  # type: ignore[arg-type]
    ("get_next timeout str", lambda r: r.session.get_next("b", after=0, timeout="1"), TYPE, "timeout"),  # type: ignore[arg-type]
    ("get_next timeout inf", lambda r: r.session.get_next("b", after=0, timeout=math.inf), VALUE, "timeout"),
    ("get_next name int", lambda r: r.session.get_next(1, after=0, timeout=1), TYPE, "name"),  # type: ignore[arg-type]
    ("ping payload str", lambda r: r.session.ping("x"), TYPE, "payload"),  # type: ignore[arg-type]
    ("ping payload too long", lambda r: r.session.ping(bytes(protocol.MAX_PING + 1)), VALUE, "payload"),
    ("forget name int", lambda r: r.session.forget(1), TYPE, "name"),  # type: ignore[arg-type]
    ("Session.subscribe name int", lambda r: r.session.subscribe(1), TYPE, "name"),  # type: ignore[arg-type]
    (
        "Session.subscribe max_in_flight 0",
        lambda r: r.session.subscribe("s", max_in_flight=0),
        VALUE,
        "max_in_flight",
    ),
    (
        "Session.subscribe max_in_flight str",
        lambda r: r.session.subscribe("s", max_in_flight="8"),
        TYPE,
        "max_in_flight",
    ),  # type: ignore[arg-type]
    ("Session.subscribe timeout negative", lambda r: r.session.subscribe("s", timeout=-1), VALUE, "timeout"),
    ("subscribe path int", lambda r: aib.subscribe(1, "s"), TYPE, "path"),  # type: ignore[arg-type]
    ("subscribe name int", lambda r: aib.subscribe(r.pub.path, 1), TYPE, "name"),  # type: ignore[arg-type]
    (
        "subscribe connect_timeout str",
        lambda r: aib.subscribe(r.pub.path, "s", connect_timeout="5"),
        TYPE,
        "connect_timeout",
    ),  # type: ignore[arg-type]
    ("subscribe timeout bool", lambda r: aib.subscribe(r.pub.path, "s", timeout=False), TYPE, "timeout"),
    # ---- export, host memory ----
    ("export copy bogus", lambda r: aib.export(BATCH, copy="bogus"), VALUE, "copy"),  # type: ignore[arg-type]
    ("export copy None", lambda r: aib.export(BATCH, copy=None), TYPE, "copy"),  # type: ignore[arg-type]
    ("export pool_fds int", lambda r: aib.export(BATCH, pool_fds=1), TYPE, "pool_fds"),  # type: ignore[arg-type]
    ("allocate_shared nbytes 0", lambda r: aib.allocate_shared(0), VALUE, "nbytes"),
    ("allocate_shared nbytes float", lambda r: aib.allocate_shared(1.5), TYPE, "nbytes"),  # type: ignore[arg-type]
    ("allocate_shared nbytes str", lambda r: aib.allocate_shared("8"), TYPE, "nbytes"),  # type: ignore[arg-type]
    ("allocate_shared name int", lambda r: aib.allocate_shared(8, name=1), TYPE, "name"),  # type: ignore[arg-type]
    ("allocate_shared name empty", lambda r: aib.allocate_shared(8, name=""), VALUE, "name"),
    ("allocate_shared name too long", lambda r: aib.allocate_shared(8, name="a" * 250), VALUE, "name"),
    ("allocate_shared name NUL", lambda r: aib.allocate_shared(8, name="a\0"), VALUE, "name"),
    # ---- devices (checked before any CUDA call: no GPU needed) ----
    ("to_device device negative", lambda r: aib.to_device(BATCH, -1), VALUE, "device"),
    ("to_device device str", lambda r: aib.to_device(BATCH, "0"), TYPE, "device"),  # type: ignore[arg-type]
    ("to_device allocation bogus", lambda r: aib.to_device(BATCH, allocation="vmm"), VALUE, "allocation"),  # type: ignore[arg-type]
    ("from_cuda_arrays list", lambda r: aib.from_cuda_arrays([1, 2]), TYPE, "columns"),  # type: ignore[arg-type]
    ("from_cuda_arrays empty", lambda r: aib.from_cuda_arrays({}), VALUE, "columns"),
    ("from_cuda_arrays int key", lambda r: aib.from_cuda_arrays({1: object()}), TYPE, "columns"),  # type: ignore[dict-item]
    # ---- imported columns ----
    ("column_view imported", lambda r: aib.column_view(object()), TYPE, "imported"),  # type: ignore[arg-type]
    ("column_view column float", lambda r: aib.column_view(r.imported, 1.5), TYPE, "column"),  # type: ignore[arg-type]
    ("column_view column negative", lambda r: aib.column_view(r.imported, -1), VALUE, "column"),
    ("column_view batch negative", lambda r: aib.column_view(r.imported, 0, batch=-1), VALUE, "batch"),
    ("column_view batch str", lambda r: aib.column_view(r.imported, 0, batch="0"), TYPE, "batch"),  # type: ignore[arg-type]
    ("column_view stream str", lambda r: aib.column_view(r.imported, 0, stream="s"), TYPE, "stream"),  # type: ignore[arg-type]
    ("column_view stream negative", lambda r: aib.column_view(r.imported, 0, stream=-2), VALUE, "stream"),
    ("column_arrays imported", lambda r: aib.column_arrays(None, "numpy"), TYPE, "imported"),  # type: ignore[arg-type]
    ("column_arrays like int", lambda r: aib.column_arrays(r.imported, 3), TYPE, "like"),
    ("column_arrays like bogus", lambda r: aib.column_arrays(r.imported, "jax"), VALUE, "like"),
    ("column_arrays like module", lambda r: aib.column_arrays(r.imported, math), VALUE, "like"),
    (
        "column_arrays batch negative",
        lambda r: aib.column_arrays(r.imported, "numpy", batch=-1),
        VALUE,
        "batch",
    ),
    ("column_arrays names str", lambda r: aib.column_arrays(r.imported, "numpy", names="x"), TYPE, "names"),
    (
        "column_arrays names of int",
        lambda r: aib.column_arrays(r.imported, "numpy", names=[1]),
        TYPE,
        "names",
    ),  # type: ignore[list-item]
    (
        "column_arrays stream float",
        lambda r: aib.column_arrays(r.imported, "numpy", stream=1.5),
        TYPE,
        "stream",
    ),  # type: ignore[arg-type]
    ("to_host imported", lambda r: aib.to_host(pa.array([1])), TYPE, "imported"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(
    ("call", "error", "argument"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS]
)
def test_bad_argument_is_refused_naming_it(
    rig: Rig, call: Call, error: type[Exception], argument: str
) -> None:
    names, version = rig.pub.names(), rig.pub.version("b")
    streams = rig.pub.stream_names()
    with pytest.raises(aib.BridgeError) as info:
        call(rig)
    exc = info.value
    assert type(exc) is error, f"{type(exc).__name__}: {exc}"
    assert exc.argument == argument  # type: ignore[attr-defined]
    assert str(exc).startswith(f"{argument} must be "), str(exc)
    assert isinstance(exc, TypeError if error is TYPE else ValueError)
    # Nothing was done: the publisher serves what it served, the session and stream go on.
    assert (rig.pub.names(), rig.pub.version("b"), rig.pub.stream_names()) == (names, version, streams)
    assert not rig.pub.closed
    assert not rig.session.closed
    assert not rig.writer.closed


def test_descriptor_numbers_out_of_range_are_invalid_arguments(rig: Rig) -> None:
    """A descriptor number no descriptor can have is an InvalidArgumentError (a ValueError) naming
    ``fds``."""
    for bad in (-1, 2**31):
        with pytest.raises(aib.InvalidArgumentError, match=r"^fds: ") as info:
            rig.session.import_message(rig.exported.message, [bad])
        assert info.value.argument == "fds"


def test_argument_errors_pickle_with_the_argument() -> None:
    for error in (
        TYPE("timeout must be ...", argument="timeout"),
        VALUE("copy must be ...", argument="copy"),
    ):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error)
        assert (again.argument, str(again)) == (error.argument, str(error))


def test_every_public_callable_has_rows() -> None:
    """The table covers every public function and class of the package root that takes arguments
    (a new one without rows fails here)."""
    covered = " ".join(row[0] for row in ROWS)
    takes_no_arguments = {"stats", "from_cuda_array"}  # from_cuda_array takes any object (capture says)
    classes_without_arguments = {"Exported", "ExportStats", "ImportedArray", "ImportedStream", "ColumnView"}
    missing = []
    for name in aib.__all__:
        obj = getattr(aib, name)
        if name.startswith("_") or (isinstance(obj, type) and issubclass(obj, BaseException)):
            continue
        if not callable(obj) or name in takes_no_arguments | classes_without_arguments:
            continue
        if name.endswith("Stats"):
            continue  # frozen records made by stats()
        if name in ("SharedHostBuffer", "StreamSlot", "StreamWriter", "LiveStream"):
            continue  # made by the bridge (allocate_shared, reserve, open_stream, subscribe)
        if name not in covered:
            missing.append(name)
    assert missing == []


# ---------- values at the edges that are allowed ----------------------------------------------------
GOOD: list[tuple[str, Call]] = [
    (
        "connect PathLike, numpy timeout",
        lambda r: aib.connect(pathlib.Path(r.pub.path), timeout=np.float64(2.0)),
    ),
    ("connect int timeout and zero linger", lambda r: aib.connect(r.pub.path, timeout=2, pool_linger=0)),
    ("connect numpy remembered_messages", lambda r: aib.connect(r.pub.path, remembered_messages=np.int32(3))),
    ("Session mapping_cache_size 0", lambda r: aib.Session(mapping_cache_size=0)),
    ("get wait 0", lambda r: r.session.get("b", wait=0)),
    ("get_next timeout None", lambda r: r.session.get_next("b", after=0, timeout=None)),
    (
        "import_message bytearray, tuple fds",
        lambda r: r.session.import_message(bytearray(r.exported.message), tuple(r.exported.fds), name="n"),
    ),
    ("ping bytearray", lambda r: r.session.ping(bytearray(b"hi"))),
    ("forget None", lambda r: r.session.forget(None)),
    ("column_view by name, numpy batch", lambda r: aib.column_view(r.imported, "y", batch=np.int64(0))),
    ("column_arrays names tuple", lambda r: aib.column_arrays(r.imported, np, names=("y", "x"))),
    ("allocate_shared numpy size", lambda r: aib.allocate_shared(np.uint16(100), name="edge")),
    ("export copy always", lambda r: aib.export(BATCH, copy="always", pool_fds=False)),
]


@pytest.mark.parametrize("call", [row[1] for row in GOOD], ids=[row[0] for row in GOOD])
def test_values_at_the_edges_are_accepted(rig: Rig, call: Call) -> None:
    result = call(rig)
    for close in ("release", "close"):  # what the call made goes now
        if hasattr(result, close):
            getattr(result, close)()
            break


def test_publish_with_a_numpy_seconds_and_pathlike_publisher(rig: Rig) -> None:
    """The publisher takes an ``os.PathLike`` and NumPy numbers, and serves as usual."""
    path = pathlib.Path(rig.path("np.sock"))
    with aib.Publisher(path, max_connections=np.int64(4), park_after=np.float32(0.5)) as pub:
        assert pub.path == str(path)
        pub.publish("x", BATCH, copy="always")
        with aib.connect(path) as session, session.get("x") as imported:
            assert pa.record_batch(imported).equals(BATCH)
