"""``bench``: quick runs between two real processes (progress, table, JSON), the plan made from the
options and what the machine has, every refused option as exit 2 with one line, a failing case, a
method that reads other data. The GPU run carries the gpu marker."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
from typing import Any

import pyarrow as pa
import pytest
from helpers.cli_runner import run_cli

from arrow_ipc_bridge.cli import bench as bench_module
from arrow_ipc_bridge.cli import build_parser, main
from arrow_ipc_bridge.cli._bench_pair import LABELS, Case, format_size, run_pair, take_samples
from arrow_ipc_bridge.cli._output import CommandError

# Small and few: a run between two processes stays within a few seconds on 2 busy cores.
_RUN = ("bench", "--device", "host", "--sizes", "64KiB,1MiB", "--repeats", "4")
_PROGRESS = re.compile(
    r"^bench: \[(\d+)/2\] host (\S+): median bridge re-get \S+ \S+, Arrow IPC file, memory_map \S+ \S+$"
)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser("arrow-ipc-bridge").parse_args(["bench", *argv])


# ---------- runs between two processes --------------------------------------------------------------
def test_bench_prints_one_progress_line_per_case_and_a_table() -> None:
    result = run_cli(*_RUN)
    assert result.returncode == 0, result.stdout + result.stderr
    progress = [m for line in result.stderr.splitlines() if (m := _PROGRESS.match(line))]
    assert [(m.group(1), m.group(2)) for m in progress] == [("1", "64KiB"), ("2", "1MiB")]
    lines = result.stdout.splitlines()
    assert re.match(r"^device\s+size\s+method\s+median\s+p90\s+x bridge$", lines[0])
    expected = [
        (size, label) for size in ("64KiB", "1MiB") for label in LABELS.values() if "torch" not in label
    ]
    for row, (size, label) in zip(lines[1:5], expected, strict=True):
        assert row.startswith(f"host    {size}"), row
        assert label in row, row
        assert re.search(r"\d+(\.\d+)? (us|ms|s)\s+\d+(\.\d+)? (us|ms|s)\s+\d+\.\d\dx$", row), row
        if label == LABELS["bridge"]:
            assert row.endswith("1.00x"), row
    assert lines[5] == ""
    assert lines[6].startswith("4 timed samples per method after 10 warm-ups")


def test_bench_json_has_the_machine_the_settings_and_sane_results() -> None:
    before = time.time()
    result = run_cli(*_RUN, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)  # stdout is the JSON alone; progress went to stderr
    assert document["schema"] == "arrow_ipc_bridge.bench/2"
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
        "warmup": 10,
    }
    assert document["skipped"] == []  # --device host: nothing of the GPU was asked for
    results = document["results"]
    assert [(r["size_bytes"], r["method"]) for r in results] == [
        (size, method) for size in (64 << 10, 1 << 20) for method in ("bridge", "ipc_file")
    ]
    medians = {}
    for row in results:
        assert row["device"] == "host"
        assert row["label"] == LABELS[row["method"]]
        assert row["size"] == format_size(row["size_bytes"])
        assert row["columns"] == 16
        assert row["rows"] == row["size_bytes"] // (16 * 8)
        samples = row["samples_us"]
        assert row["n"] == len(samples) == 4
        assert all(0 < s < 10e6 for s in samples)
        assert row["min_us"] == min(samples)
        assert row["max_us"] == max(samples)
        assert row["median_us"] == pytest.approx(statistics.median(samples))
        assert row["min_us"] <= row["median_us"] <= row["p90_us"] <= row["max_us"]
        medians[row["size_bytes"], row["method"]] = row["median_us"]
    for row in results:
        bridge = medians[row["size_bytes"], "bridge"]
        assert row["ratio_to_bridge"] == pytest.approx(row["median_us"] / bridge)


def test_a_failing_case_names_itself_and_ends_the_consumer() -> None:
    """An error in the consumer is one CommandError naming the case and the error; nothing is left
    running."""
    plan = [Case("host", 1024, ("bridge", "no_such_method"))]
    children_before = set(multiprocessing.active_children())
    started = time.monotonic()
    with pytest.raises(CommandError, match=r"in case host 1KiB: consumer: KeyError: 'no_such_method'"):
        run_pair(plan, warmup=0, repeats=1, on_case=lambda index, samples: None)
    assert time.monotonic() - started < 60
    assert set(multiprocessing.active_children()) <= children_before


def test_a_method_that_reads_other_data_fails() -> None:
    """Every sample's value is checked: the second sample of the peer reads another case's value."""
    reads = iter([0.5, 0.5, 0.5, 1.5])
    methods = {"bridge": lambda step: (1e-6, next(reads)), "ipc_file": lambda step: (1e-6, next(reads))}
    with pytest.raises(
        RuntimeError, match=r"Arrow IPC file, memory_map read 1.5, expected 0.5: not the data"
    ):
        take_samples(Case("host", 1024, ("bridge", "ipc_file")), 0.5, methods, 3)


def test_samples_alternate_between_the_methods() -> None:
    order: list[tuple[str, int]] = []

    def method(name: str) -> Any:
        def step(index: int) -> tuple[float, float]:
            order.append((name, index))
            return float(len(order)), 2.5

        return step

    taken = take_samples(Case("host", 1024, ("bridge", "ipc_file")), 2.5, {m: method(m) for m in LABELS}, 3)
    assert order == [(m, i) for i in range(3) for m in ("bridge", "ipc_file")]
    assert taken == {"bridge": [1.0, 3.0, 5.0], "ipc_file": [2.0, 4.0, 6.0]}


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
    assert bench_module.parse_size(text) == size


def test_sizes_print_as_they_parse() -> None:
    for size in (100, 1024, 1536, 64 << 10, 1 << 20, 3 << 29, 2 << 30):
        assert bench_module.parse_size(format_size(size)) == size


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
        (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
        (["--plot", "x.png"], "unrecognized arguments: --plot x.png"),  # retired: benchmarks/ has the depth
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
    """What the plan sees of the machine, set by each test: GPU 0's name, why torch cannot hold CUDA
    tensors (None: it can), the RAM. Nothing runs."""
    facts: dict[str, Any] = {"gpu": None, "torch": "torch is not installed", "memory": 64 << 30}
    monkeypatch.setattr(bench_module, "_gpu_name", lambda: facts["gpu"])
    monkeypatch.setattr(bench_module, "_torch_cuda", lambda: facts["torch"])
    monkeypatch.setattr(bench_module, "_memory_bytes", lambda: facts["memory"])
    monkeypatch.setattr(bench_module, "run_pair", _no_run)
    monkeypatch.setattr(sys, "argv", ["/x/bin/arrow-ipc-bridge"])  # the one-line errors start with it
    return facts


@pytest.mark.parametrize(
    ("args", "facts", "message"),
    [
        (["--sizes", "64B"], {}, "--sizes: 64B holds no row of 16 float64 columns (128 bytes)"),
        (["--sizes", "4MiB"], {"memory": 16 << 20}, "--sizes: 4MiB is more than 1/8 of this machine's 16MiB"),
        (["--device", "cuda"], {}, "--device cuda: no CUDA GPU here"),
        (["--device", "cuda"], {"gpu": "Fake GPU"}, "--device cuda: torch is not installed"),
    ],
)
def test_what_this_machine_cannot_do_is_one_line_and_exit_2(
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


def test_the_plan_without_a_gpu_runs_the_host_and_says_why(machine: dict[str, Any]) -> None:
    plan = bench_module.make_plan(_parse())
    assert plan.devices == ["host"]
    assert plan.sizes == (1 << 20, 64 << 20)
    assert plan.repeats == 100
    assert plan.cases == [Case("host", size, ("bridge", "ipc_file")) for size in plan.sizes]
    assert plan.skipped == {"cuda": "no CUDA GPU here (the doctor command says what the driver reports)"}


def test_the_plan_on_a_gpu_without_torch_cuda_runs_the_host_and_says_why(machine: dict[str, Any]) -> None:
    machine.update(gpu="Fake GPU", torch="this torch has no CUDA")
    plan = bench_module.make_plan(_parse("--sizes", "1MiB"))
    assert plan.devices == ["host"]
    assert plan.skipped == {"cuda": "this torch has no CUDA"}


def test_the_plan_on_a_gpu_machine_runs_both_devices(machine: dict[str, Any]) -> None:
    machine.update(gpu="Fake GPU", torch=None)
    plan = bench_module.make_plan(_parse("--sizes", "1MiB,2MiB", "--repeats", "3"))
    assert plan.devices == ["host", "cuda"]
    assert plan.cases == [
        Case("host", 1 << 20, ("bridge", "ipc_file")),
        Case("host", 2 << 20, ("bridge", "ipc_file")),
        Case("cuda", 1 << 20, ("bridge", "torch")),
        Case("cuda", 2 << 20, ("bridge", "torch")),
    ]
    assert plan.cases[0].rows == (1 << 20) // 128
    assert plan.repeats == 3
    assert plan.skipped == {}
    plan = bench_module.make_plan(_parse("--device", "cuda"))
    assert plan.devices == ["cuda"]


def test_help_names_bench_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^\s+bench\s", capsys.readouterr().out, re.MULTILINE)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for option in ("--sizes", "--repeats", "--device", "--json"):
        assert option in out


# ---------- the GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_bench_on_the_gpu_against_torch_multiprocessing(cuda_device: int) -> None:
    """CUDA columns between two processes as torch tensors: the bridge's re-get and
    torch.multiprocessing, with every value read checked."""
    torch = pytest.importorskip("torch", reason="the GPU cases use torch tensors")
    if not torch.cuda.is_available():
        pytest.skip("this torch has no CUDA")
    result = run_cli("bench", "--device", "cuda", "--sizes", "1MiB", "--repeats", "3", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(result.stdout)
    assert document["settings"]["devices"] == ["cuda"]
    assert isinstance(document["machine"]["gpu"], str)
    assert document["machine"]["versions"]["torch"] is not None
    assert [row["method"] for row in document["results"]] == ["bridge", "torch"]
    for row in document["results"]:
        assert row["device"] == "cuda"
        assert row["n"] == 3
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"]


def test_rows_leave_the_warmups_out_and_interpolate_the_p90() -> None:
    """The timed samples only (after the warm-ups), the p90 interpolated between ranks, each method's
    median over the bridge's."""
    warmups = [1.0] * bench_module.WARMUP  # seconds: far above every timed sample, so a leak shows
    samples = {"bridge": [*warmups, 1e-6, 2e-6, 3e-6, 4e-6], "ipc_file": [*warmups, 8e-6, 4e-6, 6e-6, 2e-6]}
    bridge, peer = bench_module._rows(Case("host", 1 << 20, ("bridge", "ipc_file")), samples)
    assert bridge["n"] == peer["n"] == 4
    assert bridge["samples_us"] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert (bridge["median_us"], bridge["p90_us"]) == pytest.approx((2.5, 3.7))
    assert (bridge["min_us"], bridge["max_us"]) == pytest.approx((1.0, 4.0))
    assert peer["samples_us"] == pytest.approx([8.0, 4.0, 6.0, 2.0])  # in the order taken
    assert (peer["median_us"], peer["p90_us"]) == pytest.approx((5.0, 7.4))
    assert (bridge["ratio_to_bridge"], peer["ratio_to_bridge"]) == pytest.approx((1.0, 2.0))
    one = bench_module._rows(Case("host", 1024, ("bridge",)), {"bridge": [*warmups, 3e-6]})[0]
    assert one["median_us"] == one["p90_us"] == pytest.approx(3.0)
