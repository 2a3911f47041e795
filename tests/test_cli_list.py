"""``list SOCKET``: what a running publisher serves (kind, rows, columns, device, size), as a table
and as JSON; every name fetched is released; an unreachable socket is one line and exit 1."""

from __future__ import annotations

import json
import os
import sys

import pyarrow as pa
import pytest
from helpers.cli_runner import run_cli
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.cli import main


@pytest.fixture(autouse=True)
def _called_as_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/site-packages/arrow_ipc_bridge/__main__.py"])


def _publish_three(publisher: aib.Publisher) -> pa.Table:
    batches = [
        pa.record_batch(
            {"a": pa.array(range(start, stop), pa.int64()), "b": pa.array([1.5] * (stop - start))}
        )
        for start, stop in ((0, 400), (400, 800), (800, 1000))
    ]
    table = pa.Table.from_batches(batches)  # three batches, no buffer shared: its nbytes is the size
    publisher.publish("table", table)
    publisher.publish("batch", table.combine_chunks().to_batches()[0])
    publisher.publish("array", pa.array(range(10), pa.int32()))
    return table


def test_list_prints_each_publication(publisher: aib.Publisher) -> None:
    """Run as a user would, against a publisher in this process: a table of the names, sorted."""
    table = _publish_three(publisher)
    result = run_cli("list", publisher.path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "ROWS", "COLUMNS", "DEVICE", "SIZE"]
    assert lines[1].split() == ["array", "array", "10", "1", "cpu", "40", "B"]
    assert lines[2].split()[:6] == ["batch", "record", "batch", "1000", "2", "cpu"]
    assert lines[3].split()[:5] == ["table", "table", "1000", "2", "cpu"]
    assert f"{table.nbytes / 1024:.1f} KiB" in lines[3]
    # each get was released; the publisher reads the exited process's releases on its own thread
    assert wait_for(lambda: publisher.active_leases == 0, 10.0)


def test_list_json(publisher: aib.Publisher, capsys: pytest.CaptureFixture[str]) -> None:
    table = _publish_three(publisher)
    assert main(["list", publisher.path, "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["table"] == {
        "name": "table",
        "kind": "table",
        "rows": 1000,
        "device": "cpu",
        "bytes": table.nbytes,
        "columns": 2,
        "error": None,
    }
    assert rows["batch"]["kind"] == "record batch"
    assert rows["array"]["kind"] == "array"
    assert rows["array"]["bytes"] == 40


def test_list_an_empty_publisher(publisher: aib.Publisher, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", publisher.path]) == 0
    assert capsys.readouterr().out == f"{publisher.path}: no publications\n"
    assert main(["list", publisher.path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_list_leaves_live_streams_out(publisher: aib.Publisher, capsys: pytest.CaptureFixture[str]) -> None:
    """The publisher lists its publications only; a live stream is not a row (documented)."""
    publisher.publish("array", pa.array([1, 2]))
    writer = publisher.open_stream("live")
    try:
        assert main(["list", publisher.path, "--json"]) == 0
        assert [row["name"] for row in json.loads(capsys.readouterr().out)] == ["array"]
    finally:
        writer.close()


def test_list_reports_no_publisher_in_one_line(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "nobody.sock")
    result = run_cli("list", path, "--timeout", "2")
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"python -m arrow_ipc_bridge list: cannot connect to '{path}'")


def test_a_socket_that_is_not_a_publisher(sock_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A plain file where the socket should be: one line, exit 1."""
    path = os.path.join(sock_dir, "file.sock")
    with open(path, "w") as f:
        f.write("x")
    assert main(["list", path, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m arrow_ipc_bridge list: ")
    assert len(err.splitlines()) == 1
