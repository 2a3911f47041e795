"""After ``close()``: every method of a Publisher, a Session or a LiveStream raises the same
:class:`~arrow_ipc_bridge.errors.ClosedError`, before it looks at its arguments; ``close()`` itself
stays idempotent, and the read-only facts (``closed``, counters, ``path``) stay readable.

(It used to differ by method: ``names()`` said ``[]``, ``unpublish`` "not published", ``publish``
"this publisher is closed".)
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import pyarrow as pa
import pytest
from helpers.counting import SessionCounts

import arrow_ipc_bridge as aib

BATCH = pa.record_batch({"x": [1, 2, 3]})

PublisherCall = Callable[[aib.Publisher], object]
PUBLISHER_CALLS: list[tuple[str, PublisherCall]] = [
    ("publish", lambda p: p.publish("b", BATCH)),
    ("publish a new name", lambda p: p.publish("new", BATCH)),
    ("publish with a bad name", lambda p: p.publish(1, BATCH)),  # type: ignore[arg-type]
    ("publish with a bad copy", lambda p: p.publish("b", BATCH, copy="bogus")),  # type: ignore[arg-type]
    ("unpublish", lambda p: p.unpublish("b")),
    ("unpublish unknown", lambda p: p.unpublish("never")),
    ("version", lambda p: p.version("b")),
    ("names", lambda p: p.names()),
    ("open_stream", lambda p: p.open_stream("s")),
    ("open_stream with bad options", lambda p: p.open_stream("s", max_in_flight=0)),
    ("publish_stream", lambda p: p.publish_stream("s", [BATCH])),
    ("stream_names", lambda p: p.stream_names()),
]


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("call", [c[1] for c in PUBLISHER_CALLS], ids=[c[0] for c in PUBLISHER_CALLS])
def test_every_publisher_method_raises_closed_error(sock_dir: str, call: PublisherCall) -> None:
    pub = aib.Publisher(os.path.join(sock_dir, "p.sock"))
    pub.publish("b", BATCH)
    path = pub.path
    pub.close()
    with pytest.raises(aib.ClosedError, match=r"^this publisher is closed") as info:
        call(pub)
    assert info.value.what == "publisher"  # type: ignore[attr-defined]
    assert isinstance(info.value, ValueError)
    # close() stays idempotent; the facts stay readable and say closed.
    pub.close()
    pub.close(timeout=0)
    assert pub.closed
    assert (pub.path, pub.active_leases, pub.active_sessions, pub.held_waits) == (path, 0, 0, 0)


@pytest.mark.usefixtures("no_leaks")
def test_stream_writer_of_a_closed_publisher_raises_closed_error(sock_dir: str) -> None:
    pub = aib.Publisher(os.path.join(sock_dir, "p.sock"))
    writer = pub.open_stream("s")
    pub.close()
    with pytest.raises(aib.ClosedError, match=r"^this publisher is closed"):
        writer.write(BATCH)
    assert writer.closed  # the publisher ended the stream
    writer.close()  # idempotent


SessionCall = Callable[[aib.Session], object]
SESSION_CALLS: list[tuple[str, SessionCall]] = [
    ("get", lambda s: s.get("b")),
    ("get with a bad name", lambda s: s.get(1)),  # type: ignore[arg-type]
    ("get with wait", lambda s: s.get("b", wait=1)),
    ("get with a bad wait", lambda s: s.get("b", wait="x")),  # type: ignore[arg-type]
    ("get_next", lambda s: s.get_next("b", after=0, timeout=1)),
    ("get_next with a bad after", lambda s: s.get_next("b", after=-1, timeout=1)),
    ("list", lambda s: s.list()),
    ("ping", lambda s: s.ping()),
    ("ping with a bad payload", lambda s: s.ping("x")),  # type: ignore[arg-type]
    ("forget", lambda s: s.forget()),
    ("forget a name", lambda s: s.forget("b")),
    ("import_message", lambda s: s.import_message(b"\0" * 16, [])),
    ("import_message with a bad message", lambda s: s.import_message("x")),  # type: ignore[arg-type]
    ("subscribe", lambda s: s.subscribe("s")),
]


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("call", [c[1] for c in SESSION_CALLS], ids=[c[0] for c in SESSION_CALLS])
def test_every_session_method_raises_closed_error(publisher: aib.Publisher, call: SessionCall) -> None:
    counts = SessionCounts()
    publisher.publish("b", BATCH)
    session = aib.connect(publisher.path)
    session.get("b").release()
    session.close()
    with pytest.raises(aib.ClosedError, match=r"^this session is closed") as info:
        call(session)
    assert info.value.what == "session"  # type: ignore[attr-defined]
    session.close()  # idempotent
    assert session.closed
    assert counts.remembered_gets == 0  # counters stay readable


@pytest.mark.parametrize("call", [c[1] for c in SESSION_CALLS], ids=[c[0] for c in SESSION_CALLS])
def test_a_closed_unconnected_session_says_closed_not_unconnected(call: SessionCall) -> None:
    """A Session() that never connected says "closed" once closed, not "not connected": the same
    error for every call."""
    session = aib.Session()
    session.close()
    with pytest.raises(aib.ClosedError, match=r"^this session is closed"):
        call(session)


@pytest.mark.usefixtures("no_leaks")
def test_a_closed_live_stream_raises_closed_error(publisher: aib.Publisher) -> None:
    writer = publisher.open_stream("s")
    live = aib.subscribe(publisher.path, "s", timeout=5.0)
    writer.write(BATCH)
    live.close()
    for call in (live.next_batch, lambda: next(live), lambda: live.next_batch(timeout=0)):
        with pytest.raises(aib.ClosedError, match=r"^the live stream 's' is closed") as info:
            call()
        assert info.value.what == "live stream"  # type: ignore[attr-defined]
    with pytest.raises(aib.ClosedError):
        live.next_batch(timeout="bad")  # type: ignore[arg-type]  # closed first, as elsewhere
    live.close()  # idempotent
    assert live.closed
    writer.close()


def test_a_closed_export_has_no_descriptors_to_send() -> None:
    """``Exported.fds`` after ``close()`` raises ClosedError: the numbers it held were closed, and the
    next files this process opens get them (a script once sent such a file to its peer)."""
    exported = aib.export(BATCH, copy="always")
    assert len(exported.fds) == 1
    exported.close()
    with pytest.raises(aib.ClosedError, match="export is closed") as info:
        _ = exported.fds
    assert info.value.what == "export"  # type: ignore[attr-defined]
    exported.close()  # idempotent
    assert exported.closed
    assert exported.message  # the bytes stay readable (they name no descriptor number)


def test_closed_error_pickles_with_what() -> None:
    error = aib.ClosedError("this session is closed", what="session")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is aib.ClosedError
    assert (again.what, str(again)) == ("session", "this session is closed")
