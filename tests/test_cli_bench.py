"""``bench``: quick runs between two real processes (progress, table, JSON, plot), the plan made from
the options and what the machine has, every refused option as exit 2 with one line, a missing
matplotlib, a failing case, and a consumer that reads stale data. The GPU run carries the gpu marker."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.cli_runner import run_cli

from arrow_ipc_bridge.cli import _bench_pair, build_parser, main
from arrow_ipc_bridge.cli import bench as bench_module
from arrow_ipc_bridge.cli._bench_cases import BRIDGE_CASES, CASE_LABELS, ConsumerCase, Shape
from arrow_ipc_bridge.cli._bench_options import (
    QUICK_REPEATS,
    QUICK_SIZES,
    format_size,
    parse_size,
)
from arrow_ipc_bridge.cli._bench_pair import PlanItem, run_pair
from arrow_ipc_bridge.cli._output import CommandError

# Small and few: each run between two processes stays within a few seconds on 2 busy cores.
_RUN = ("bench", "--device", "host", "--sizes", "64KiB,1MiB", "--repeats", "4", "--peers", "ipc,pickle")
_CASES = (*BRIDGE_CASES, "ipc", "pickle")
_PROGRESS = re.compile(r"^bench: \[(\d+)/(\d+)\] host (\S+) (.+): median \S+ \S+, p90 \S+ \S+$")


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser("arrow-ipc-bridge").parse_args(["bench", *argv])


def _progress_lines(stderr: str) -> list[re.Match[str]]:
    return [match for line in stderr.splitlines() if (match := _PROGRESS.match(line))]


# ---------- runs between two processes ------------------------------------------------------------------
def test_bench_prints_one_progress_line_per_case_and_a_table() -> None:
    result = run_cli(*_RUN)
    assert result.returncode == 0, result.stdout + result.stderr
    progress = _progress_lines(result.stderr)
    assert [int(m.group(1)) for m in progress] == list(range(1, 11))
    assert {int(m.group(2)) for m in progress} == {10}
    assert [(m.group(3), m.group(4)) for m in progress] == [
        (size, CASE_LABELS[case]) for size in ("64KiB", "1MiB") for case in _CASES
    ]
    lines = result.stdout.splitlines()
    assert re.match(r"^device\s+size\s+case\s+median\s+p90\s+vs bridge fresh$", lines[0])
    rows = lines[1:11]
    for row, (size, case) in zip(rows, [(s, c) for s in ("64KiB", "1MiB") for c in _CASES], strict=True):
        assert row.startswith(f"host    {size}"), row
        assert CASE_LABELS[case] in row, row
        assert re.search(r"\d+(\.\d+)? (us|ms|s)\s+\d+(\.\d+)? (us|ms|s)\s+\d+\.\d\dx$", row), row
        if case == "bridge_fresh":
            assert row.endswith("1.00x"), row
    assert "4 timed samples per case after 2 warm-ups" in result.stdout


def test_bench_json_has_the_machine_the_settings_and_sane_results() -> None:
    before = time.time()
    result = run_cli(*_RUN, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)  # stdout is the JSON alone; progress went to stderr
    assert len(_progress_lines(result.stderr)) == 10
    assert document["schema"] == "arrow_ipc_bridge.bench/1"
    machine = document["machine"]
    assert machine["cpu_count"] == os.cpu_count()
    assert 1 <= machine["cpus_usable"] <= machine["cpu_count"]
    date = time.mktime(time.strptime(machine["date_utc"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert before - 5 <= date <= time.time() + 5
    assert machine["gpu"] is None or isinstance(machine["gpu"], str)
    versions = machine["versions"]
    assert versions["pyarrow"] == pa.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert document["settings"] == {
        "devices": ["host"],
        "sizes_bytes": [64 << 10, 1 << 20],
        "columns": 16,
        "repeats": 4,
        "warmup": 2,
        "cases": list(_CASES),
    }
    assert document["plot"] is None
    results = document["results"]
    assert [(r["size_bytes"], r["case"]) for r in results] == [
        (size, case) for size in (64 << 10, 1 << 20) for case in _CASES
    ]
    medians = {}
    for row in results:
        assert row["device"] == "host"
        assert row["label"] == CASE_LABELS[row["case"]]
        assert row["size"] == format_size(row["size_bytes"])
        assert row["rows"] == row["size_bytes"] // (16 * 8)
        assert row["bytes_moved"] == row["rows"] * 16 * 8
        samples = row["samples_us"]
        assert row["n"] == len(samples) == 4
        assert all(0 < s < 10e6 for s in samples)
        assert row["min_us"] == min(samples)
        assert row["max_us"] == max(samples)
        assert row["median_us"] == pytest.approx(statistics.median(samples))
        assert row["min_us"] <= row["median_us"] <= row["p90_us"] <= row["max_us"]
        assert row["first_us"] > 0
        medians[row["size_bytes"], row["case"]] = row["median_us"]
    for row in results:
        fresh = medians[row["size_bytes"], "bridge_fresh"]
        assert row["ratio_to_bridge_fresh"] == pytest.approx(row["median_us"] / fresh)
    # 1 MiB pickled through a pipe costs milliseconds; a re-get copies nothing (tens of µs)
    assert medians[1 << 20, "pickle"] > medians[1 << 20, "bridge_reget"]
    assert isinstance(document["skipped"], list)


def test_bench_writes_a_png_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the 'plot' extra)")
    path = tmp_path / "bench.png"
    result = run_cli(*_RUN, "--plot", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == f"plot written to {path}"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300
    assert height > 200
    assert data[-8:-4] == b"IEND"


def test_a_failing_case_names_itself_and_ends_both_processes() -> None:
    """An error in a child is one CommandError naming the case and the error; nothing is left running."""
    plan = [PlanItem("no_such_case", 1024, Shape("host", 1, 128))]
    children_before = set(multiprocessing.active_children())
    started = time.monotonic()
    with pytest.raises(CommandError, match=r"in case no_such_case \(host, 1KiB\): producer: KeyError"):
        run_pair(plan, warmup=0, repeats=1, on_case=lambda index, samples: None)
    assert time.monotonic() - started < 60
    assert set(multiprocessing.active_children()) <= children_before


class _Control:
    """The producer's answers, as the consumer's control connection receives them."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)

    def recv(self) -> Any:
        last = self.sent[-1]
        return {"start": ("ready",), "prepare": ("prepared", last[-1]), "end": ("ended",)}[last[0]]


class _StaleSide(ConsumerCase):
    def fetch(self, step: int) -> float:
        return 1.0  # what the producer wrote for step 1, read again at every step


def test_a_consumer_that_reads_stale_data_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bench_pair, "consumer_case", lambda case, links, shape: _StaleSide())
    links: Any = argparse.Namespace(control=_Control())
    item = PlanItem("bridge_fresh", 1024, Shape("host", 1, 128))
    with pytest.raises(RuntimeError, match=r"sample 2 read 1.0, expected 2.0: the data moved is not"):
        _bench_pair._run_case(links, item, 3)


# ---------- options and the plan ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64MiB", 64 << 20),
        ("1.5KiB", 1536),
        ("100", 100),
        ("2gib", 2 << 30),
        ("512 B", 512),
        ("1mib", 1 << 20),
    ],
)
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_sizes_print_as_they_parse() -> None:
    for size in (100, 1024, 1536, 64 << 10, 1 << 20, 3 << 29, 2 << 30):
        assert parse_size(format_size(size)) == size


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "12XB"], "argument --sizes: bad size '12XB': use a number and B, KiB, MiB or GiB"),
        (["--sizes", "0"], "argument --sizes: bad size '0': must be a whole number of bytes, at least 1"),
        (["--sizes", "1.5B"], "argument --sizes: bad size '1.5B': must be a whole number of bytes"),
        (["--sizes", "1MiB,1024KiB"], "argument --sizes: 1MiB is given twice"),
        (["--sizes", ""], "argument --sizes: bad size ''"),
        (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
        (["--repeats", "many"], "argument --repeats: expected a whole number, got 'many'"),
        (["--columns", "-1"], "argument --columns: must be at least 1, got -1"),
        (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
        (["--peers", "torch,mpi"], "argument --peers: unknown peer 'mpi'"),
        (["--peers", "ipc,ipc"], "argument --peers: peer 'ipc' is given twice"),
        (
            ["--plot", "/no/such/directory/x.png"],
            "argument --plot: the directory /no/such/directory does not exist",
        ),
        (["--plot", "/tmp/"], "argument --plot: '/tmp/' is not a file name"),
    ],
)
def test_bad_options_are_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    assert "Traceback" not in err


def _no_run(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("nothing may run when an option is refused")


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What the plan sees of the machine, set by each test: installed modules, GPU 0's name, torch's
    CUDA, the RAM. Nothing runs."""
    facts: dict[str, Any] = {"installed": {"numpy"}, "gpu": None, "torch_cuda": False, "memory": 64 << 30}
    monkeypatch.setattr(bench_module, "_installed", lambda module: module in facts["installed"])
    monkeypatch.setattr(bench_module, "_gpu_name", lambda: facts["gpu"])
    monkeypatch.setattr(bench_module, "_torch_has_cuda", lambda: facts["torch_cuda"])
    monkeypatch.setattr(bench_module, "_memory_bytes", lambda: facts["memory"])
    monkeypatch.setattr(bench_module, "run_pair", _no_run)
    monkeypatch.setattr(sys, "argv", ["/x/bin/arrow-ipc-bridge"])  # the one-line errors start with it
    return facts


@pytest.mark.parametrize(
    ("args", "facts", "message"),
    [
        (["--sizes", "64B"], {}, "--sizes: 64B holds no row of 16 float64 columns (128 bytes)"),
        (["--sizes", "4MiB"], {"memory": 16 << 20}, "--sizes: 4MiB is more than 1/8 of this machine's 16MiB"),
        (["--peers", "torch"], {}, "--peers torch: torch is not installed (pip install torch)"),
        (["--device", "cuda"], {}, "--device cuda: no CUDA GPU here"),
        (
            ["--device", "cuda"],
            {"gpu": "Fake GPU"},
            "--device cuda: the CUDA cases use CuPy arrays, and CuPy is",
        ),
        (
            ["--device", "cuda", "--peers", "torch"],
            {"gpu": "Fake GPU", "installed": {"numpy", "cupy", "torch"}},
            "--peers torch: this torch has no CUDA",
        ),
        (["--quick"], {"installed": set()}, "bench makes its columns with numpy, which is not installed"),
    ],
)
def test_options_this_machine_cannot_honour_are_one_line_and_exit_2(
    args: list[str],
    facts: dict[str, Any],
    message: str,
    machine: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    machine.update(facts)
    assert main(["bench", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("arrow-ipc-bridge bench: ")
    assert message in captured.err


def test_plot_without_matplotlib_is_one_line_naming_the_extra(
    machine: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["bench", "--plot", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err == (
        "arrow-ipc-bridge bench: --plot needs matplotlib, which is not installed: "
        "pip install arrow_ipc_bridge[plot]\n"
    )
    assert not (tmp_path / "x.png").exists()


def test_the_plan_without_gpu_or_torch_runs_the_host_and_says_what_it_skips(machine: dict[str, Any]) -> None:
    plan = bench_module.make_plan(_parse())
    assert plan.devices == ["host"]
    assert plan.sizes == (1 << 20, 8 << 20, 64 << 20)
    assert (plan.repeats, plan.warmup, plan.columns) == (20, 2, 16)
    assert [(item.shape.device, item.size, item.case) for item in plan.items] == [
        ("host", size, case) for size in plan.sizes for case in (*BRIDGE_CASES, "ipc", "pickle")
    ]
    assert all(item.shape == Shape("host", 16, item.size // 128) for item in plan.items)
    assert [s.line() for s in plan.skipped] == [
        "skipped cuda cases: no CUDA GPU here (the doctor command says what the driver reports)",
        "skipped torch.multiprocessing Queue (host): torch is not installed (pip install torch)",
    ]


def test_the_plan_on_a_gpu_machine_runs_both_devices_and_every_peer(machine: dict[str, Any]) -> None:
    machine.update(gpu="Fake GPU", installed={"numpy", "cupy", "torch"}, torch_cuda=True)
    plan = bench_module.make_plan(_parse("--sizes", "1MiB", "--columns", "4", "--repeats", "3"))
    assert plan.devices == ["host", "cuda"]
    every = (*BRIDGE_CASES, "torch", "ipc", "pickle")
    assert [(item.shape.device, item.case) for item in plan.items] == [
        (device, case) for device in ("host", "cuda") for case in every
    ]
    assert plan.items[0].shape == Shape("host", 4, (1 << 20) // 32)
    assert plan.skipped == []


def test_auto_on_a_gpu_without_cupy_runs_the_host_and_says_why(machine: dict[str, Any]) -> None:
    machine.update(gpu="Fake GPU")
    plan = bench_module.make_plan(_parse("--peers", "none", "--device", "auto"))
    assert plan.devices == ["host"]
    assert [item.case for item in plan.items[:3]] == list(BRIDGE_CASES)
    assert len(plan.items) == 3 * 3
    assert plan.skipped[0].line().startswith("skipped cuda cases: the CUDA cases use CuPy arrays")


def test_quick_picks_small_sizes_and_few_samples_unless_told(machine: dict[str, Any]) -> None:
    plan = bench_module.make_plan(_parse("--quick"))
    assert (plan.sizes, plan.repeats, plan.warmup) == (QUICK_SIZES, QUICK_REPEATS, 1)
    plan = bench_module.make_plan(_parse("--quick", "--sizes", "2MiB,128KiB", "--repeats", "7"))
    assert (plan.sizes, plan.repeats) == ((128 << 10, 2 << 20), 7)


def test_percentile_interpolates_between_ranks() -> None:
    assert bench_module.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert bench_module.percentile([1.0, 2.0, 3.0, 4.0], 0.9) == pytest.approx(3.7)
    assert bench_module.percentile([5.0], 0.9) == 5.0


def test_help_names_bench_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+bench\s", capsys.readouterr().out, re.MULTILINE)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for option in ("--sizes", "--columns", "--repeats", "--device", "--peers", "--json", "--plot", "--quick"):
        assert option in out


# ---------- the GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_bench_on_the_gpu_moves_cuda_columns(cuda_device: int) -> None:
    """CuPy columns between two processes: the bridge's cases, Arrow IPC and pickle (through the
    host), and torch.multiprocessing where torch with CUDA is installed."""
    pytest.importorskip("cupy", reason="the CUDA cases use CuPy arrays")
    result = run_cli("bench", "--device", "cuda", "--sizes", "1MiB", "--repeats", "3", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["settings"]["devices"] == ["cuda"]
    assert isinstance(document["machine"]["gpu"], str)
    assert document["machine"]["versions"]["cupy"] is not None
    cases = [row["case"] for row in document["results"]]
    assert cases[:3] == list(BRIDGE_CASES)
    assert {"ipc", "pickle"} <= set(cases)
    skipped = {entry["case"] for entry in document["skipped"]}
    assert ("torch" in cases) != ("torch" in skipped)
    for row in document["results"]:
        assert row["device"] == "cuda"
        assert row["n"] == 3
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"]
