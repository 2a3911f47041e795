"""``doctor``: versions, memfd and seals, kernel, open-file limit, socket directory, namespaces, and
CUDA (no GPU here: the driver-absent path, and the two-process harness reporting a failing handle
kind; the GPU test checks every kind works)."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli_runner import REPO, TIMEOUT_S, run_cli

from arrow_ipc_bridge.cli import doctor as doctor_module
from arrow_ipc_bridge.cli import main
from arrow_ipc_bridge.cli.doctor import Check, cuda_checks, host_checks


def _checks(out: str) -> dict[str, dict[str, str]]:
    return {check["name"]: check for check in json.loads(out)["checks"]}


def test_doctor_reports_every_host_fact() -> None:
    """As a user runs it: versions first, then one line per check; exit 0 when nothing failed."""
    from arrow_ipc_bridge import __version__
    from arrow_ipc_bridge._ffi import WIRE_VERSION

    result = run_cli("doctor", "--no-cuda-processes")
    assert result.returncode == 0, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(
        f"arrow_ipc_bridge {__version__}, wire format {WIRE_VERSION[0]}.{WIRE_VERSION[1]}"
    )
    for pattern in (
        r"^info\s+kernel\s+Linux ",
        r"^ok\s+memfd\s+",
        r"^ok\s+memfd seals\s+",
        r"^(ok|warn)\s+F_SEAL_FUTURE_WRITE\s+",
        r"^(ok|warn)\s+open-file limit\s+RLIMIT_NOFILE soft \d+",
        r"^(ok|warn)\s+socket directory\s+",
        r"^info\s+ipc namespace\s+",
        r"^info\s+pid namespace\s+",
        r"^info\s+CUDA\s+(driver not found|driver present, \d+ device)",
    ):
        assert re.search(pattern, result.stdout, re.MULTILINE), pattern
    assert result.stderr == ""


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-cuda-processes"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    names = {check["name"] for check in report["checks"]}
    assert {
        "kernel",
        "memfd",
        "memfd seals",
        "F_SEAL_FUTURE_WRITE",
        "open-file limit",
        "socket directory",
    } <= names
    assert {"ipc namespace", "pid namespace", "CUDA"} <= names
    assert set(report["versions"]) == {"arrow_ipc_bridge", "wire_format", "pyarrow", "python"}


def test_a_low_open_file_limit_is_a_warning_with_advice() -> None:
    """Run under ``ulimit -n 1024``: the limit is named, with how to raise it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard limit here ({hard}) is below the limit this test sets")
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def lower_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    result = subprocess.run(
        [sys.executable, "-m", "arrow_ipc_bridge", "doctor", "--json", "--no-cuda-processes"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        preexec_fn=lower_limit,
        check=False,
    )
    assert result.returncode == 0, result.stderr  # a warning is not a failure
    check = _checks(result.stdout)["open-file limit"]
    assert check["status"] == "warn"
    assert "soft 1024" in check["detail"]
    assert "ulimit -n" in check["advice"]


def test_a_missing_socket_directory_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A check that fails makes the exit status 1."""
    missing = tmp_path / "nowhere"
    assert main(["doctor", "--json", "--no-cuda-processes", "--socket-dir", str(missing)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    check = _checks(json.dumps(report))["socket directory"]
    assert check["status"] == "fail"
    assert str(missing) in check["detail"]
    assert check["advice"]


def test_a_world_writable_socket_directory_without_sticky_bit_warns(tmp_path: Path) -> None:
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    check = next(c for c in host_checks(str(directory)) if c.name == "socket directory")
    assert check.status == "warn"
    assert "sticky" in check.detail


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_socket_directory_fails(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        check = next(c for c in host_checks(str(directory)) if c.name == "socket directory")
    finally:
        directory.chmod(0o755)
    assert check.status == "fail"
    assert "not writable" in check.detail


def test_namespaces_are_compared_with_pid_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each namespace says whether it is pid 1's; an unreadable /proc/1 says so rather than guessing."""
    links = {
        "/proc/self/ns/ipc": "ipc:[1]",
        "/proc/1/ns/ipc": "ipc:[2]",
        "/proc/self/ns/pid": "pid:[3]",
        "/proc/1/ns/pid": "pid:[3]",
    }

    def readlink(path: str) -> str:
        if path in links:
            return links[path]
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(doctor_module.os, "readlink", readlink)
    checks = {c.name: c for c in doctor_module._namespace_checks()}
    assert checks["ipc namespace"].detail == "ipc:[1], differs from pid 1's"
    assert checks["pid namespace"].detail == "pid:[3], same as pid 1's"
    assert "not readable" in checks["net namespace"].detail or "unknown" in checks["net namespace"].detail


def test_no_cuda_driver_is_reported_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from arrow_ipc_bridge import cuda

    monkeypatch.setattr(cuda, "driver_available", lambda: False)
    assert cuda_checks() == [Check("CUDA", "info", "driver not found (host memory only)")]


@pytest.mark.parametrize("kind", ["pool", "vmm"])
def test_a_handle_kind_failing_between_processes_is_reported_with_advice(kind: str) -> None:
    """The two-process harness itself, where the kind cannot work (no GPU here, or the child fails):
    a ``fail`` naming the exporting side's error, what to change, and no child left running."""
    import multiprocessing

    if doctor_module._gpu_usable():
        pytest.skip("a usable GPU: the GPU test covers this path")
    check = doctor_module._try_handle_kind(kind)
    assert check.name == f"CUDA {kind} handles"
    assert check.status == "fail"
    assert check.detail.startswith("between two processes: exporting: ")
    assert check.advice == doctor_module._KIND_ADVICE[kind]
    assert multiprocessing.active_children() == []


@pytest.mark.gpu
def test_every_cuda_handle_kind_works_between_two_processes(cuda_device: int) -> None:
    result = run_cli("doctor", "--json")
    checks = _checks(result.stdout)
    for kind in ("legacy", "pool", "vmm"):
        assert checks[f"CUDA {kind} handles"]["status"] == "ok", checks[f"CUDA {kind} handles"]
