"""``inspect FILE``: every root kind of the golden messages (plain array, record batch, nested,
table), regions by name, rows and bytes, ``--json``, and one-line errors with exit 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.cli_runner import run_cli

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.cli import main

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(autouse=True)
def _called_as_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() names itself after sys.argv[0]: as ``python -m arrow_ipc_bridge`` here, whatever runs pytest."""
    monkeypatch.setattr(sys, "argv", ["/site-packages/arrow_ipc_bridge/__main__.py"])


def _inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("golden", "root", "rows", "fields"),
    [
        ("dictionary.bin", "array", 4, [": dictionary<values=string, indices=int32, ordered=0>"]),
        ("primitive_batch.bin", "record batch", 3, ["i: int32", "f: double"]),
        ("table_two_batches.bin", "table of 2 batches", 5, ["v: int64", "origin: 'golden'"]),
        ("nested_struct_sliced.bin", "record batch", 2, ["s: string", "l: list<item: int16> not null"]),
        ("wide_16_float32.bin", "record batch", 8, ["c0: float", "c15: float"]),
    ],
)
def test_inspect_prints_every_golden_message(
    golden: str, root: str, rows: int, fields: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Size, wire version, root kind, rows, data bytes, device, regions by name and the schema; a
    plain-array root (dictionary.bin) included."""
    path = GOLDEN / golden
    code, out, err = _inspect(capsys, str(path))
    assert code == 0, err
    lines = out.splitlines()
    size = path.stat().st_size
    assert lines[0].startswith(f"{path}: {size} bytes, wire 1.0, {root}, {rows} rows, ")
    assert lines[1] == "device: cpu"
    assert lines[2].startswith("region 0: host_fd, ")
    assert "kind=" not in out
    stripped = [line.strip() for line in lines]
    for field in fields:
        assert field in stripped
    assert err == ""


def test_inspect_json_is_the_same_facts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _inspect(capsys, str(GOLDEN / "table_two_batches.bin"), "--json")
    assert code == 0
    facts = json.loads(out)
    assert facts["kind"] == "stream"
    assert facts["batches"] == 2
    assert facts["rows_per_batch"] == [3, 2]
    assert facts["rows"] == 5
    assert facts["regions"][0]["kind"] == "host_fd"
    assert facts["schema"] == [{"name": "v", "type": "int64"}]
    assert facts["device"]["type"] == "cpu"


def test_inspect_names_region_flags_of_an_exported_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A message exported here (copied into a sealed memfd): its region says host_fd, sealed; its
    data bytes are the table's buffers."""
    table = pa.table({"a": pa.array(range(1000), pa.int64())})
    with aib.export(table, copy="always") as exported:
        path = tmp_path / "m.bin"
        path.write_bytes(exported.message)
        n_fds = len(exported.fds)
    code, out, err = _inspect(capsys, str(path), "--fds", str(n_fds), "--json")
    assert code == 0, err
    facts = json.loads(out)
    assert facts["rows"] == 1000
    assert facts["data_bytes"] == table.nbytes
    assert facts["regions"][0]["kind"] == "host_fd"
    assert "sealed" in facts["regions"][0]["flags"]


def test_inspect_reports_a_corrupt_message_in_one_line(tmp_path: Path) -> None:
    """As a user runs it: the decoder's reason on one stderr line, exit 1, no traceback."""
    data = bytearray((GOLDEN / "primitive_batch.bin").read_bytes())
    data[0] ^= 0xFF  # the magic
    path = tmp_path / "corrupt.bin"
    path.write_bytes(bytes(data))
    result = run_cli("inspect", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"python -m arrow_ipc_bridge inspect: {path}: invalid message: ")


@pytest.mark.parametrize("content", [b"", b"not a message at all", bytes(100)])
def test_inspect_refuses_garbage(content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "garbage.bin"
    path.write_bytes(content)
    code, out, err = _inspect(capsys, str(path))
    assert code == 1
    assert out == ""
    assert f"{path}: invalid message: " in err
    assert len(err.splitlines()) == 1


def test_inspect_checks_the_descriptor_count(capsys: pytest.CaptureFixture[str]) -> None:
    """A message naming fd 0 inspected as if no descriptor travelled with it is invalid."""
    code, _, err = _inspect(capsys, str(GOLDEN / "primitive_batch.bin"), "--fds", "0")
    assert code == 1
    assert "invalid message" in err
    assert "fd" in err


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_inspect_reports_a_file_it_cannot_read(
    make: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nothing.bin"
    if make == "directory":
        path.mkdir()
    code, out, err = _inspect(capsys, str(path))
    assert code == 1
    assert out == ""
    assert err.startswith(f"python -m arrow_ipc_bridge inspect: cannot read {path}: ")
    assert len(err.splitlines()) == 1


def test_a_missing_file_as_a_user_runs_it() -> None:
    result = run_cli("inspect", "/nonexistent/message.bin")
    assert result.returncode == 1
    assert result.stderr == (
        "python -m arrow_ipc_bridge inspect: cannot read /nonexistent/message.bin: "
        "No such file or directory\n"
    )
