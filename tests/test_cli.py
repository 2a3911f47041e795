"""The command line (``python -m arrow_ipc_bridge``): doctor, inspect and demo, each run as a user
would, in a subprocess with a timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).parent.parent
TIMEOUT_S = 120  # generous: CI runs on 2 busy cores


def run_cli(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "arrow_ipc_bridge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_doctor_reports_versions_and_devices() -> None:
    """doctor prints the package and wire versions, pyarrow's, /dev/shm and the CUDA state; exit 0."""
    from arrow_ipc_bridge import __version__
    from arrow_ipc_bridge._ffi import WIRE_VERSION

    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(
        f"arrow_ipc_bridge {__version__}, wire format {WIRE_VERSION[0]}.{WIRE_VERSION[1]}"
    )
    assert "pyarrow " in first
    assert re.search(r"/dev/shm (present|missing)", result.stdout)
    assert re.search(r"CUDA driver(: not found| present, \d+ device\(s\))", result.stdout)


@pytest.mark.parametrize(
    ("golden", "kind", "batches", "fields"),
    [
        ("primitive_batch.bin", "array", 1, ["i: int32", "f: double"]),
        ("table_two_batches.bin", "stream", 2, ["v: int64", "origin: 'golden'"]),
        ("nested_struct_sliced.bin", "array", 1, ["s: string", "l: list<item: int16> not null"]),
        ("wide_16_float32.bin", "array", 1, ["c0: float", "c15: float"]),
    ],
)
def test_inspect_prints_a_golden_message(golden: str, kind: str, batches: int, fields: list[str]) -> None:
    """inspect decodes a message file and prints its size, wire version, kind, batch count, device,
    regions and schema (record-batch and stream roots)."""
    path = GOLDEN / golden
    result = run_cli("inspect", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    size = path.stat().st_size
    assert re.match(
        rf"{size} bytes, wire \d+\.\d+, {kind}, {batches} batch\(es\), \d+ schema nodes$", lines[0]
    )
    assert lines[1].startswith("device: DeviceInfo(device_type=1")
    assert lines[2].startswith("region 0: Region(kind=2")
    for field in fields:
        assert field in lines
    assert result.stderr == ""


def test_inspect_reports_an_invalid_message(tmp_path: Path) -> None:
    """A corrupted message is reported as invalid with the decoder's reason; exit 1, no traceback."""
    data = bytearray((GOLDEN / "primitive_batch.bin").read_bytes())
    data[0] ^= 0xFF  # the magic
    path = tmp_path / "corrupt.bin"
    path.write_bytes(bytes(data))
    result = run_cli("inspect", str(path))
    assert result.returncode == 1
    assert result.stdout.startswith("invalid: ")
    assert "Traceback" not in result.stderr


def test_inspect_checks_the_descriptor_count() -> None:
    """A message naming fd 0 inspected as if no descriptor travelled with it is invalid."""
    result = run_cli("inspect", str(GOLDEN / "primitive_batch.bin"), "--fds", "0")
    assert result.returncode == 1
    assert result.stdout.startswith("invalid: ")


def test_a_subcommand_is_required() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "required" in result.stderr


def test_demo_shares_a_table_between_two_processes() -> None:
    """demo starts a producer and a consumer process; the consumer lists the names and reads both host
    tables, whose last column sums to the expected value; both processes exit 0."""
    rows, columns = 1000, 3
    result = run_cli("demo", "--rows", str(rows), "--columns", str(columns))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"producer pid \d+: published ", out)
    assert re.search(r"consumer pid \d+: publisher serves \[.*'copied'.*'zero_copy'.*\]", out)
    expected_sum = float(columns - 1) * rows  # column c{i} holds the value i in every row
    for name in ("copied", "zero_copy"):
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert line.endswith(f"last column sums to {expected_sum}"), line
    # the memory-mapped table needs no copy at all
    assert re.search(r"'zero_copy' \(0 bytes copied, 1 zero-copy region\)", out)
