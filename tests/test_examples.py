"""Every script in examples/ runs as a user would run it, in a subprocess with a timeout, and must
exit 0, print what it promises, and leave nothing behind: no process it started (consumers,
multiprocessing's helpers) and no file in its temporary directory (socket files).

How "nothing behind" is checked: each run gets a fresh ``TMPDIR`` (the examples make their socket
directories with ``tempfile``) and a marker in its environment, which every process it starts
inherits; after the script exits, any process still carrying the marker is a stray (waited for a
few seconds, since multiprocessing's resource tracker exits just after its parent), then killed.
``test_the_leak_checks_catch_a_leaky_script`` proves both checks can fail.

Optional libraries are skipped with the reason when absent (pandas and DuckDB are in the test
extra, so CI runs those); GPU examples carry the ``gpu`` marker and the ``cuda_device`` fixture.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
EXAMPLES = REPO / "examples"
TIMEOUT_S = 120  # each example takes a few seconds; generous for 2 busy CI cores
STRAY_GRACE_S = 10.0  # how long processes of a finished run may take to exit
MARKER = "AIB_EXAMPLE_RUN"


@dataclass
class ExampleRun:
    """What one run of a script did, and what it left behind."""

    returncode: int
    stdout: str
    stderr: str
    stray_processes: list[str] = field(default_factory=list)  # "pid cmdline" of each, killed since
    leftover_files: list[str] = field(default_factory=list)  # paths under its TMPDIR

    def lines(self) -> list[str]:
        return self.stdout.splitlines()


def _is_zombie(pid: int) -> bool:
    """True when ``pid`` has exited and waits for its parent to reap it (FileNotFoundError: gone)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"


def _gone_within(pid: int, timeout: float) -> bool:
    """True once ``pid`` has exited (gone, or a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _is_zombie(pid):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _processes_with(marker: str) -> dict[int, str]:
    """Live processes (not zombies) whose environment holds ``MARKER=marker``: pid -> command line."""
    needle = f"{MARKER}={marker}".encode()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle not in environ.read().split(b"\0"):
                    continue
            if _is_zombie(int(entry)):
                continue  # exited, waiting for its parent to reap it
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                found[int(entry)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or not ours
    return found


def run_script(
    script: Path, *args: str, timeout: float = TIMEOUT_S, grace: float = STRAY_GRACE_S
) -> ExampleRun:
    """Run ``script`` with this Python, a fresh TMPDIR and a marker; collect its output and leftovers.

    Stray processes are killed (SIGKILL) after they are recorded, and the TMPDIR is removed, so a
    failing example does not disturb the tests after it."""
    marker = uuid.uuid4().hex
    tmpdir = tempfile.mkdtemp(dir="/tmp", prefix="aibx-")  # short: AF_UNIX paths are limited to ~107 bytes
    env = dict(os.environ)
    # Buffered output, as a user's run has: a producer and its consumer share the output file, and
    # unbuffered, print() writes a line's text and its newline apart, so two processes' lines can
    # interleave mid-line. The examples flush each line they print.
    env.pop("PYTHONUNBUFFERED", None)
    env.update({MARKER: marker, "TMPDIR": tmpdir})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # Output goes to files, not pipes: a stray that inherited a pipe would hold it open, and reading
    # it to its end would wait for the stray.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=out, stderr=err, env=env, cwd=REPO
        )
        try:
            returncode = process.wait(timeout=timeout)
            timed_out = ""
        except subprocess.TimeoutExpired:
            process.kill()
            returncode = process.wait()
            timed_out = f"\n[timed out after {timeout} s]"
        out.seek(0)
        err.seek(0)
        run = ExampleRun(
            returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace") + timed_out
        )
    try:
        deadline = time.monotonic() + grace
        strays = _processes_with(marker)
        while strays and time.monotonic() < deadline:
            time.sleep(0.1)
            strays = _processes_with(marker)
        for pid, cmdline in strays.items():
            run.stray_processes.append(f"{pid} {cmdline}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for root, dirs, files in os.walk(tmpdir):
            run.leftover_files += [os.path.join(root, name) for name in dirs + files]
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return run


def run_example(name: str) -> ExampleRun:
    """Run examples/``name`` and check it succeeded and left nothing behind."""
    run = run_script(EXAMPLES / name)
    report = f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 0, report
    assert run.stray_processes == [], report
    assert run.leftover_files == [], report
    assert "Traceback" not in run.stderr, report
    return run


def line_matching(run: ExampleRun, pattern: str) -> re.Match[str]:
    """The first stdout line that ``pattern`` matches (re.search), or a failure showing the output."""
    for line in run.lines():
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"no line matches {pattern!r} in:\n{run.stdout}\nstderr:\n{run.stderr}")


# --- the checks themselves ---------------------------------------------------------------------------------


def test_the_leak_checks_catch_a_leaky_script(tmp_path: Path) -> None:
    """A script that leaves a socket file and a running child behind is reported (and cleaned up):
    the checks every example passes can fail."""
    script = tmp_path / "leaky.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, socket, subprocess, sys, tempfile
            directory = tempfile.mkdtemp()
            socket.socket(socket.AF_UNIX).bind(os.path.join(directory, "left.sock"))
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
            print("leaving")
            """
        )
    )
    started = time.monotonic()
    run = run_script(script, grace=1.0)
    assert run.returncode == 0, run.stderr
    assert run.lines() == ["leaving"]
    assert [os.path.basename(path) for path in run.leftover_files][-1:] == ["left.sock"]
    assert len(run.stray_processes) == 1
    assert "time.sleep(60)" in run.stray_processes[0]
    assert time.monotonic() - started < 30  # the stray was killed, not waited for
    pid = int(run.stray_processes[0].split()[0])
    assert _gone_within(pid, 10.0)


def test_every_example_has_a_test_and_a_readme_entry() -> None:
    """A new script in examples/ must be run here and described in examples/README.md."""
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    tested = {
        name.removeprefix("test_example_") + ".py" for name in globals() if name.startswith("test_example_")
    }
    readme = (EXAMPLES / "README.md").read_text()
    assert [name for name in scripts if name not in tested] == []
    assert [name for name in scripts if f"({name})" not in readme] == []


# --- host examples (run in CI) -----------------------------------------------------------------------------


def test_example_pyarrow_host() -> None:
    run = run_example("pyarrow_host.py")
    line_matching(run, r"^producer: prices published, 0 bytes copied$")
    line_matching(run, r"^producer: trades published, [1-9]\d* bytes copied once$")
    line_matching(run, r"^consumer: the publisher serves \['prices', 'trades'\]$")
    # sum of 0.5 * i for i < 1,000,000
    line_matching(run, r"^consumer: prices has 1000000 rows, sum 249999750000\.0$")
    line_matching(run, r"'symbol': \['AAPL', 'MSFT', 'NVDA'\], 'qty_sum': \[17, 6, 3\]")
    line_matching(run, r"^producer: done, 0 leases still held$")


def test_example_polars_consumer() -> None:
    pytest.importorskip("polars", reason="the polars example needs polars (pip install polars)")
    run = run_example("polars_consumer.py")
    line_matching(run, r"^consumer: polars read 200000 rows, columns \['sensor', 'second', 'celsius'\]$")
    for sensor in range(4):
        line_matching(run, rf"^consumer: sensor {sensor}: 50000 readings, mean \d+\.\d+ C$")
    line_matching(run, r"^producer: done, 0 leases still held$")


def test_example_duckdb_query() -> None:
    pytest.importorskip("duckdb", reason="the DuckDB example needs duckdb (pip install duckdb)")
    run = run_example("duckdb_query.py")
    for symbol in ("AAPL", "AMZN", "MSFT", "NVDA"):
        line_matching(run, rf"^consumer: {symbol}: 125000 trades, notional \d+\.\d$")
    line_matching(run, r"^consumer: largest NVDA trade 99$")
    line_matching(run, r"^producer: done, 0 leases still held$")


def test_example_pandas_zero_copy() -> None:
    """The zero-copy ways grow private memory by far less than the 64 MiB table; the default copy
    by about all of it (bounds generous: the allocator and pandas' own objects move a few MiB)."""
    pytest.importorskip("pandas", reason="the pandas example needs pandas (pip install pandas)")
    run = run_example("pandas_zero_copy.py")
    line_matching(run, r"^consumer: 1048576 rows x 8 columns, 64 MiB$")
    expected_sum = r"4398071676928"  # 8 * sum(range(2**20)) + 2**20 * sum(range(8))
    for way, low, high in (
        (r"split_blocks=True", -64, 16),  # it may shrink a little: freed pages go back meanwhile
        (r"types_mapper=pd\.ArrowDtype", -64, 16),
        (r"default \(copies\)", 48, 1024),
    ):
        found = line_matching(
            run, rf"to_pandas\({way}\): private memory \+(-?[\d.]+) MiB, sum {expected_sum}$"
        )
        assert low <= float(found.group(1)) <= high, found.group(0)
    line_matching(run, r"^producer: done, 0 leases still held$")


def test_example_live_stream() -> None:
    """Every frame arrives in order, none dropped, the checksum matches the producer's; under
    ``on_slow="block"`` the consumer never held more than its max_in_flight of 4."""
    run = run_example("live_stream.py")
    line_matching(run, r"^consumer: received 200 frames in order, 0 dropped, checksum \d+$")
    got = line_matching(run, r"checksum (\d+)$").group(1)
    assert line_matching(run, r"^producer: expected checksum (\d+)$").group(1) == got
    most = line_matching(run, r"^producer: 200 frames in [\d.]+ s, at most (\d+) unreleased at once")
    assert 1 <= int(most.group(1)) <= 4, most.group(0)


def test_example_next_version() -> None:
    """The consumer waited for the publisher and the name, then followed get_next to the last step,
    versions only increasing (how many it skipped depends on timing)."""
    run = run_example("next_version.py")
    line_matching(run, r"^consumer: waiting for the publisher$")
    found = line_matching(
        run, r"^consumer: got (\d+) versions, steps increasing: True, last step 29, (\d+) skipped while busy$"
    )
    assert int(found.group(1)) + int(found.group(2)) == 30
    line_matching(run, r"^producer: published 30 versions, the last is 30$")


def test_example_weight_sync() -> None:
    """The trainer published every version into slots no consumer held; the inference process saw
    only whole versions (every parameter at one step), viewed in place."""
    run = run_example("weight_sync.py")
    line_matching(
        run,
        r"^trainer: published 40 versions of 120 parameters \([\d.]+ MiB\) in [\d.]+ s, "
        r"\d+ waits for a free slot, 0 bytes copied by the bridge$",
    )
    line_matching(
        run,
        r"^inference: \d+ versions, each whole \(120 parameters at one step\), \d+ skipped, "
        r"parameters viewed in place on the host$",
    )


def test_example_ray_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Ray actors passed a shared-memory table (0 bytes copied) and a heap table through the
    bridge's transport, by socket on one node; the consumer read both without allocating, and both
    were unpublished once the refs went."""
    pytest.importorskip("ray", reason="the Ray example needs ray (pip install 'arrow_ipc_bridge[ray]')")
    # Ray's session files (sockets among them: a short path for AF_UNIX), outside the example's
    # temporary directory, whose leftover files the harness checks.
    ray_tmp = tempfile.mkdtemp(dir="/tmp", prefix="aibray-")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    try:
        run = run_example("ray_transport.py")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    line_matching(run, r"prices published as \S+, 0 bytes copied")
    line_matching(run, r"arrived by socket \(same Ray node\)")
    line_matching(run, r"pyarrow allocated 0 bytes for both tables")
    line_matching(run, r"both unpublished after the refs went, no lease left")


def test_example_own_socket() -> None:
    run = run_example("own_socket.py")
    line_matching(run, r"^producer: exported \d+ bytes of metadata and 1 fd\(s\)")
    line_matching(
        run, r"^consumer: received \d+ bytes and 1 fd\(s\), imported 3000 rows \['symbol', 'qty'\]$"
    )
    line_matching(run, r"^consumer: total qty 4498500, symbols \['AAPL', 'MSFT', 'NVDA'\]$")
    line_matching(run, r"^producer: the consumer said 'done'$")


def test_example_own_multiprocessing() -> None:
    run = run_example("own_multiprocessing.py")
    line_matching(run, r"^consumer: imported 1000000 rows from 1 fd\(s\), sum of x 499999500000$")
    line_matching(run, r"^producer: the consumer's sum 499999500000, expected 499999500000$")


# --- GPU examples (run where there is a GPU: scripts/gpu-check.sh) -----------------------------------------


@pytest.mark.gpu
def test_example_cupy_to_torch(cuda_device: int) -> None:
    pytest.importorskip("cupy", reason="the CuPy producer needs cupy (pip install arrow_ipc_bridge[cuda12])")
    torch = pytest.importorskip("torch", reason="the PyTorch consumer needs torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch was built without CUDA")
    run = run_example("cupy_to_torch.py")
    line_matching(run, r"^producer: published 1048576 rows on GPU \d+, 0 bytes copied$")
    line_matching(
        run, r"^consumer: tensors on cuda:\d+: x torch\.int64 \(1048576,\), y torch\.float64 \(1048576,\)$"
    )
    got = line_matching(run, r"^consumer: sum\(x\) (\d+), sum\(y\) ([\d.]+)$")
    expected = line_matching(run, r"^producer: expected sum\(x\) (\d+), sum\(y\) ([\d.]+)$")
    assert got.groups() == expected.groups() == ("549755289600", "274877644800.0")


@pytest.mark.gpu
def test_example_pylibcudf_consumer(cuda_device: int) -> None:
    pytest.importorskip("pylibcudf", reason="the pylibcudf consumer needs cuDF's pylibcudf (RAPIDS)")
    run = run_example("pylibcudf_consumer.py")
    line_matching(run, r"^producer: published 1048576 rows on the GPU$")
    line_matching(run, r"^consumer: pylibcudf table of 1048576 rows x 2 columns$")
    got = line_matching(run, r"^consumer: sum\(id\) on the GPU (\d+)$").group(1)
    assert got == line_matching(run, r"^producer: expected sum\(id\) (\d+)$").group(1) == "549755289600"
