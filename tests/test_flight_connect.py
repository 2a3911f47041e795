"""``aib.connect("grpc://...")``: the publisher's socket when this process can use it (same host,
admitted uid, the same publisher), Arrow Flight otherwise, with the same ``list`` / ``get`` /
``subscribe``; ``route`` and ``route_reason`` say which and why. The fallbacks: a missing socket
file, another uid (a spawned child that switches uid, as root), another host (another boot id),
another publisher at the advertised path; ``prefer="local"`` raises instead."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import sample_table, wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.errors import BridgeTimeoutError, NotPublishedError, TransportError

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import FlightFront, LocalLocation, serve  # noqa: E402
from arrow_ipc_bridge.flight import locations as flight_locations  # noqa: E402

TOKEN = "connect-test-token-0123456789abcdef"
NOBODY = 65534
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def front(publisher: aib.Publisher) -> Iterator[FlightFront]:
    publisher.publish("t", sample_table(300, batches=2))
    with serve(publisher, tokens=[TOKEN]) as f:
        yield f


def test_same_host_and_uid_take_the_socket(front: FlightFront, publisher: aib.Publisher) -> None:
    with aib.connect(front.location, token=TOKEN) as session:
        assert isinstance(session, aib.Session)
        assert session.route == "local"
        assert publisher.path in session.route_reason
        assert session.list() == ["t"]
        with session.get("t") as imported:
            assert isinstance(imported, aib.ImportedStream)  # zero-copy, over the mappings
            assert_arrays_equal(pa.table(imported), sample_table(300, batches=2))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {
            "check": "none",
            "pool_linger": 0.25,
            "remembered_messages": 3,
            "timeout": 2.0,
        },
    ],
    ids=["defaults", "given"],
)
def test_a_routed_session_is_the_session_connect_path_makes(
    front: FlightFront, publisher: aib.Publisher, options: dict[str, object]
) -> None:
    """The same-host session reached through the gRPC address is configured exactly as
    ``connect(path)`` makes it (the session options reach it; nothing of the Flight client stays
    with it), and its re-gets take the same steady path: remembered, no import in Python
    (``benchmarks/bench_flight.py`` times the two against each other)."""
    with (
        aib.connect(publisher.path, **options) as plain,  # type: ignore[arg-type]
        aib.connect(front.location, token=TOKEN, **options) as routed,  # type: ignore[arg-type]
    ):
        assert type(routed) is type(plain) is aib.Session
        for attribute in (
            *("_host_check", "_cuda_check", "_timeout", "_timeout_ms", "_path", "_reader"),
            "_pool_linger",
        ):
            assert getattr(routed, attribute) == getattr(plain, attribute), attribute
        assert routed._remembered._pool_linger == plain._remembered._pool_linger
        # both keep standing leases (the board taken) and kept CuPy arrays
        for session in (plain, routed):
            assert session._board is not None
            assert session._kept_arrays is not None
        assert not any(isinstance(value, flight.FlightClient) for value in vars(routed).values()), (
            "the routed session keeps a Flight client"
        )
        for session in (plain, routed):
            with session.get("t"):
                pass
            before = aib.stats().session
            for _ in range(3):
                with session.get("t") as imported:
                    pa.table(imported)
            after = aib.stats().session
            assert after.remembered_gets - before.remembered_gets == 3
            assert after.python_imports == before.python_imports


def test_a_flight_session_keeps_the_servers_suggestion_for_an_unknown_name(front: FlightFront) -> None:
    """``NotPublishedError`` over Flight carries the front's message, its "did you mean" and the
    names it serves included, as a session over the socket does."""
    with aib.connect(front.location, token=TOKEN, prefer="flight") as session:
        with pytest.raises(NotPublishedError) as missing:
            session.get("tt")
        assert "did you mean 't'?" in str(missing.value)
        assert "publications: 't'" in str(missing.value)
        with pytest.raises(NotPublishedError, match="did you mean 't'"):
            session.subscribe("tt")
        assert "Detail" not in str(missing.value)  # pyarrow's appended traceback is left out


def test_prefer_flight_gives_the_same_methods_over_grpc(front: FlightFront, publisher: aib.Publisher) -> None:
    with aib.connect(front.location, token=TOKEN, prefer="flight") as session:
        assert session.route == "flight"
        assert session.route_reason == "prefer='flight'"
        assert session.list() == ["t"]
        with session.get("t") as got:
            assert_arrays_equal(pa.table(got), sample_table(300, batches=2))
            assert got.num_rows == 600
            assert got.device == "cpu"
        assert got.released
        with pytest.raises(NotPublishedError):
            session.get("missing")
        with pytest.raises(BridgeTimeoutError):
            session.get("missing", wait=0.1)
        writer = publisher.open_stream("live", max_in_flight=2)

        def produce() -> None:
            wait_for(lambda: writer.subscribers > 0, 10.0)
            for i in range(5):
                writer.write(pa.record_batch({"i": [i]}))
            writer.close()

        producer = threading.Thread(target=produce)
        producer.start()
        with session.subscribe("live") as live:
            assert [pa.table(b).column(0)[0].as_py() for b in live] == list(range(5))
        producer.join(10)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_a_missing_socket_file_falls_back_to_flight(front: FlightFront, publisher: aib.Publisher) -> None:
    os.rename(publisher.path, publisher.path + ".moved")  # the front's own session stays connected
    try:
        with aib.connect(front.location, token=TOKEN) as session:
            assert session.route == "flight"
            assert "not reachable" in session.route_reason
            assert session.list() == ["t"]
        with pytest.raises(TransportError, match="cannot take the publisher's socket"):
            aib.connect(front.location, token=TOKEN, prefer="local")
    finally:
        os.rename(publisher.path + ".moved", publisher.path)


def test_another_host_falls_back_to_flight(front: FlightFront, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flight_locations, "boot_id", lambda: "another-host-boot-id")
    with aib.connect(front.location, token=TOKEN) as session:
        assert session.route == "flight"
        assert session.route_reason == "the server runs on another host"


def test_another_publisher_at_the_path_falls_back_to_flight(front: FlightFront) -> None:
    real = front.local_location
    assert real is not None
    front.local_location = LocalLocation(real.socket_path, "0" * 32, real.boot_id, real.uid)
    with aib.connect(front.location, token=TOKEN) as session:
        assert session.route == "flight"
        assert session.route_reason == "the socket at that path is another publisher"


def test_a_wrong_token_is_refused_before_any_route(front: FlightFront) -> None:
    with pytest.raises(TransportError, match="refused this client") as raised:
        aib.connect(front.location, token="not-the-token-0123456789")
    assert raised.value.reason == "rejected"
    with pytest.raises(TransportError) as raised:
        aib.connect(front.location)
    assert raised.value.reason == "rejected"


def test_connect_checks_its_arguments(front: FlightFront, publisher: aib.Publisher) -> None:
    with pytest.raises(ValueError, match="prefer must be one of"):
        aib.connect(front.location, token=TOKEN, prefer="fast")
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['token'\\]"):
        aib.connect(publisher.path, token=TOKEN)


def _child_connect(uri: str, token: str, uid: int, out: Connection) -> None:
    """Spawned child: become ``uid``, connect through the front, report the route and a get."""
    import pyarrow.flight  # noqa: F401  (imported as root: the interpreter's files may be root-only)

    import arrow_ipc_bridge.flight.client  # noqa: F401

    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        with aib.connect(uri, token=token) as session, session.get("t") as got:
            out.send(("ok", session.route, session.route_reason, pa.table(got).num_rows))
    except Exception as exc:  # reported to the parent, which asserts on it
        out.send(("error", type(exc).__name__, str(exc)))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching a child to another uid needs root")
def test_another_uid_falls_back_to_flight(sock_dir: str) -> None:
    # allowed_uids names a third uid, so the socket file is 0666 and the child reaches it: the
    # publisher's SO_PEERCRED check is what refuses it.
    with aib.Publisher(os.path.join(sock_dir, "p.sock"), allowed_uids=[NOBODY - 1]) as pub:
        pub.publish("t", pa.table({"x": list(range(10))}))
        with serve(pub, tokens=[TOKEN]) as f:
            parent, child = SPAWN.Pipe()
            proc = SPAWN.Process(target=_child_connect, args=(f.location, TOKEN, NOBODY, child))
            proc.start()
            try:
                assert parent.poll(60), "the child did not answer"
                result = parent.recv()
            finally:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    assert result[:2] == ("ok", "flight"), result
    assert "refused this uid" in result[2]
    assert result[3] == 10
