"""Errors that guide: what a user who followed the README gets wrong says what is there and what to do.

An unknown name lists what is published (the first few) and the closest name; a live stream asked
for with ``get``, or a publication with ``subscribe``, names the other call; a column
``column_arrays`` cannot take says how to leave it out or read it; a session whose publisher went
away says to connect again. Names come from the other process: the messages show a bounded few,
cut short and escaped.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.errors import NAMES_SHOWN, closest_name, names_shown, shown_name

_TABLE = pa.table({"v": [1, 2, 3]})


def test_an_unknown_name_lists_the_published_ones_and_the_closest(publisher: aib.Publisher) -> None:
    names = ["orders", "prices", "quotes", "trades", "weights", "x1", "x2", "x3"]
    for name in names:
        publisher.publish(name, _TABLE)
    with aib.connect(publisher.path) as session:
        with pytest.raises(aib.NotPublishedError) as info:
            session.get("trade")
        message = str(info.value)
        assert "nothing is published as 'trade'; did you mean 'trades'?" in message
        assert "published: 'orders', 'prices', 'quotes', 'trades', 'weights' and 3 more" in message
        assert "Session.list()" in message
        # the session is still usable: the error is the publisher's answer, not a broken connection
        with session.get("trades") as imported:
            assert pa.table(imported).equals(_TABLE)
        with pytest.raises(aib.NotPublishedError) as info:
            session.get("zzzzzzzz")
        assert "did you mean" not in str(info.value)


def test_an_unknown_name_when_nothing_is_published_says_how_to_wait(publisher: aib.Publisher) -> None:
    with aib.connect(publisher.path) as session, pytest.raises(aib.NotPublishedError) as info:
        session.get("trades")
    assert "nothing else is published now" in str(info.value)
    assert "wait=" in str(info.value)


def test_the_asked_name_is_escaped_and_cut_short(publisher: aib.Publisher) -> None:
    """A name from a client (or a publisher's names, in its listing) may hold terminal escapes or be
    4096 bytes long: the message shows it escaped and cut to 40 characters."""
    publisher.publish("trades", _TABLE)
    hostile = "\x1b[2J\x1b[31m" + "y" * 3000
    with aib.connect(publisher.path) as session, pytest.raises(aib.NotPublishedError) as info:
        session.get(hostile)
    message = str(info.value)
    assert "\x1b" not in message
    assert "'\\x1b[2J\\x1b[31m" in message
    assert len(message) < 400


def test_get_of_a_live_stream_suggests_subscribe(publisher: aib.Publisher) -> None:
    publisher.open_stream("frames", max_in_flight=2)
    with aib.connect(publisher.path) as session, pytest.raises(aib.NotPublishedError) as info:
        session.get("frames")
    assert "'frames': it is a live stream; subscribe to it (Session.subscribe)" in str(info.value)


def test_subscribe_to_a_publication_suggests_get(publisher: aib.Publisher) -> None:
    publisher.publish("trades", _TABLE)
    publisher.open_stream("frames", max_in_flight=2)
    with aib.connect(publisher.path) as session:
        with pytest.raises(aib.NotPublishedError) as info:
            session.subscribe("trades")
        assert "'trades': it is a publication, not a live stream; read it with Session.get" in str(info.value)
        with pytest.raises(aib.NotPublishedError) as info:
            session.subscribe("frame")
        assert "did you mean 'frames'? (open streams: 'frames')" in str(info.value)


def test_unpublish_of_an_unknown_name_suggests_the_closest(publisher: aib.Publisher) -> None:
    publisher.publish("trades", _TABLE)
    with pytest.raises(aib.NotPublishedError) as info:
        publisher.unpublish("trade")
    assert "did you mean 'trades'?" in str(info.value)
    assert "Publisher.names()" in str(info.value)


def test_a_column_with_nulls_says_what_to_do(publisher: aib.Publisher) -> None:
    batch = pa.record_batch({"x": pa.array([1.0, None]), "y": pa.array([1.0, 2.0]), "s": ["a", "b"]})
    publisher.publish("nulls", batch)
    with aib.connect(publisher.path) as session, session.get("nulls") as imported:
        with pytest.raises(aib.BridgeError) as info:
            aib.column_arrays(imported, "numpy")
        message = str(info.value)
        assert "column 'x' has nulls" in message
        assert "pass names= without it (numeric columns without nulls: 'y')" in message
        assert "pyarrow.compute.fill_null" in message
        assert "pa.table(imported)" in message
        with pytest.raises(aib.BridgeError) as info:
            aib.column_view(imported, "x")
        assert "pyarrow.compute.fill_null" in str(info.value)
        assert "names=" not in str(info.value)  # column_view takes one column


def test_an_unknown_column_lists_the_columns_and_the_closest(publisher: aib.Publisher) -> None:
    publisher.publish("b", pa.record_batch({"price": [1.0], "volume": [2.0]}))
    with aib.connect(publisher.path) as session, session.get("b") as imported:
        for call in (
            lambda: aib.column_view(imported, "prices"),
            lambda: aib.column_arrays(imported, "numpy", names=["prices"]),
        ):
            with pytest.raises(aib.BridgeError) as info:
                call()
            assert str(info.value) == (
                "no column named 'prices'; did you mean 'price'? (columns: 'price', 'volume')"
            )


def test_a_vanished_publisher_says_to_connect_again(sock_dir: str) -> None:
    path = f"{sock_dir}/gone.sock"
    publisher = aib.Publisher(path)
    publisher.publish("trades", _TABLE)
    session = aib.connect(path)
    try:
        publisher.close()
        with pytest.raises(aib.PeerClosedError) as info:
            session.get("trades")
        assert "connect again" in str(info.value)
        with pytest.raises(aib.PeerClosedError) as info:  # and every later call on the connection
            session.list()
        assert "connect again" in str(info.value)
    finally:
        session.close()


def test_listings_are_bounded() -> None:
    names = [f"name{i:05d}" + "z" * 100 for i in range(10_000)]
    listed = names_shown(names)
    assert listed.count("'") == 2 * NAMES_SHOWN
    assert listed.endswith(f"and {len(names) - NAMES_SHOWN} more")
    assert len(listed) < 400
    assert shown_name("a" * 41) == repr("a" * 40) + "..."
    assert shown_name("\n") == "'\\n'"
    # a long asked name, or candidates too long to compare cheaply, get no suggestion
    assert closest_name("x" * 65, ["x" * 65]) is None
    assert closest_name("abcd", ["abcd" + "e" * 100]) is None
    assert closest_name("trade", ["trades", "orders"]) == "trades"


def test_a_wait_for_a_publisher_names_the_timeout_given(sock_dir: str) -> None:
    """The time left of the user's timeout reaches the transport as a float a few microseconds short
    of it: the message shows it rounded (0.3 s, not 0.29998834299999544 s)."""
    with pytest.raises(aib.BridgeTimeoutError) as info:
        aib.connect(f"{sock_dir}/nobody.sock", timeout=0.3, wait_for_publisher=True)
    assert "within 0.3 s" in str(info.value)
