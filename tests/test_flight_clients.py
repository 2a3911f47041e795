"""Clients that know nothing of the bridge: a process in which ``arrow_ipc_bridge`` cannot even be
imported reads the front with ``pyarrow.flight`` alone and queries the result with DuckDB and
polars; and the ``serve-flight`` command serving a publisher until SIGTERM."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest
from helpers.session_rig import read_line, wait_for

import arrow_ipc_bridge as aib

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import serve  # noqa: E402

TOKEN = "client-test-token-0123456789abcdef"

# The client process: the bridge made unimportable, then pyarrow.flight, DuckDB and polars.
_CLIENT = textwrap.dedent(
    """
    import sys

    class NoBridge:
        def find_spec(self, name, path=None, target=None):
            if name == "arrow_ipc_bridge" or name.startswith("arrow_ipc_bridge."):
                raise ImportError("the bridge is not installed on this client")
            return None

    sys.meta_path.insert(0, NoBridge())
    import pyarrow.flight as flight

    location, token = sys.argv[1], sys.argv[2]
    options = flight.FlightCallOptions(headers=[(b"authorization", ("Bearer " + token).encode())])
    client = flight.connect(location)
    (info,) = list(client.list_flights(options=options))
    table = client.do_get(info.endpoints[0].ticket, options=options).read_all()
    print("rows", table.num_rows, "sum", sum(table.column("x").to_pylist()))
    try:
        import duckdb
    except ImportError:
        print("duckdb missing")
    else:
        con = duckdb.connect()
        con.register("trades", table)
        print("duckdb", con.execute("SELECT sum(x), count(*) FROM trades WHERE s <> 'b'").fetchone())
    try:
        import polars
    except ImportError:
        print("polars missing")
    else:
        frame = polars.from_arrow(table)
        print("polars", frame.filter(polars.col("s") == "b")["x"].sum())
    print("bridge imported", any(m.startswith("arrow_ipc_bridge") for m in sys.modules))
    """
)


def test_a_client_without_the_bridge_reads_with_pyarrow_duckdb_and_polars(publisher: aib.Publisher) -> None:
    table = pa.table({"x": pa.array(range(1000), pa.int64()), "s": pa.array(["a", "b"] * 500)})
    publisher.publish("trades", table)
    with serve(publisher, tokens=[TOKEN]) as front:
        out = subprocess.run(
            [sys.executable, "-c", _CLIENT, front.location, TOKEN],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"rows 1000 sum {sum(range(1000))}"
    evens = sum(range(0, 1000, 2))
    odds = sum(range(1, 1000, 2))
    # Where this interpreter has DuckDB / polars, the client (same interpreter) must have used them.
    expect_duckdb = importlib.util.find_spec("duckdb") is not None
    expect_polars = importlib.util.find_spec("polars") is not None
    assert (f"duckdb ({evens}, 500)" in lines) == expect_duckdb, lines
    assert (f"polars {odds}" in lines) == expect_polars, lines
    assert lines[-1] == "bridge imported False"


def test_serve_flight_command_serves_until_sigterm(publisher: aib.Publisher, tmp_path: object) -> None:
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    token_file = os.path.join(str(tmp_path), "tokens")
    with open(token_file, "w") as f:
        f.write(f"\n{TOKEN}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arrow_ipc_bridge",
            "serve-flight",
            publisher.path,
            "--token-file",
            token_file,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = read_line(proc.stdout, 60.0)
        assert line.startswith(f"serving {publisher.path} at grpc://127.0.0.1:")
        location = line.rsplit(" ", 1)[1]
        options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
        with flight.connect(location) as client:
            assert client.do_get(flight.Ticket(b"t"), options=options).read_all().num_rows == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    # The front's releases reach the publisher on its connection's thread, after the client ended.
    assert wait_for(lambda: publisher.active_leases == 0, 10.0)


def test_serve_flight_command_refuses_to_serve_everyone_by_default(publisher: aib.Publisher) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "arrow_ipc_bridge", "serve-flight", publisher.path],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "anyone who reaches it" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
