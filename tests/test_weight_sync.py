"""examples/weight_sync.py: a trainer's parameters published every step, an inference process
following them in place, never reading a half-written version.

On the host (CI): the layout (mixed dtypes and shapes in one aligned byte buffer, its digest
checked), the version check itself (it catches a version mixing two steps), the slot rule (a slot a
consumer holds is never written: publishing waits, then fails, and the held version keeps its
values), zero-copy (the consumer's parameters lie in the producer's shared memory, writes by the
producer show through), many fast free-running steps between two processes with every version
whole, and the example run as a user runs it. GPU tests (PyTorch with CUDA) do the same on the
device; they skip with the reason elsewhere.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arrow_ipc_bridge as aib

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))  # the example module (spawned children import it too)

import weight_sync as ws  # noqa: E402

SPAWN = mp.get_context("spawn")
SOON = 20.0  # generous for 2 busy cores; what should happen takes milliseconds


@pytest.fixture
def socket_path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="aib-ws-") as directory:
        yield os.path.join(directory, "trainer.sock")


def small_model(total: int = 1 << 20, tensors: int = 30) -> tuple[list[Any], dict[str, str], ws.Layout]:
    spec = ws.model_spec(total, tensors)
    return spec, {name: dtype for name, dtype, _ in spec}, ws.Layout.plan(spec)


# ---------- the layout ------------------------------------------------------------------------------------


def test_model_spec_is_a_1gb_model_of_300_mixed_tensors() -> None:
    spec = ws.model_spec(1 << 30, 300)
    layout = ws.Layout.plan(spec)
    assert len(spec) == len(layout.specs) == 300
    assert {dtype for _, dtype, _ in spec} == {"bfloat16", "float16", "float32", "int64"}
    assert 0.9 * (1 << 30) < layout.total_bytes < 1.1 * (1 << 30)
    assert len({shape for _, _, shape in spec}) >= 5


def test_layout_places_every_parameter_aligned_grouped_by_dtype_without_overlap() -> None:
    layout = ws.Layout.plan([("a", "float32", (3, 5)), ("b", "bfloat16", (7,)), ("c", "float32", (1,))])
    assert [s.name for s in layout.specs] == ["a", "c", "b"]  # float32 together, in the order given
    ends = 0
    for spec in layout.specs:
        assert spec.offset % ws.ALIGNMENT == 0
        assert spec.offset >= ends
        ends = spec.offset + spec.nbytes
    assert [s.nbytes for s in layout.specs] == [60, 4, 14]
    assert layout.total_bytes == 3 * ws.ALIGNMENT
    assert layout.column == f"weights:{layout.layout_id}"


def test_layout_round_trips_through_its_table_and_checks_its_digest() -> None:
    _, _, layout = small_model()
    batch = layout.to_batch()
    again = ws.Layout.from_batch(batch)
    assert again.specs == layout.specs
    assert again.layout_id == layout.layout_id
    other = ws.Layout.plan([("x", "int64", (4,))])
    forged = batch.replace_schema_metadata({"layout_id": other.layout_id, "alignment": "256"})
    with pytest.raises(ws.LayoutError, match="describes"):
        ws.Layout.from_batch(forged)
    assert ws.Layout.plan([("x", "int64", (5,))]).layout_id != other.layout_id  # a shape changes it


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ([("a", "complex64", (2,))], "unknown|known"),
        ([("a", "int64", (2,)), ("a", "int64", (3,))], "unique"),
        ([], "at least one"),
    ],
)
def test_layout_refuses_what_it_cannot_describe(parameters: list[Any], message: str) -> None:
    with pytest.raises(ws.LayoutError, match=message):
        ws.Layout.plan(parameters)


def test_views_give_every_parameter_its_dtype_shape_and_bytes() -> None:
    spec, _, layout = small_model()
    parameters = ws.host_parameters(spec)
    flat = np.zeros(layout.total_bytes, dtype=np.uint8)
    views = ws.parameter_views(flat, layout)
    for k, (name, value) in enumerate(parameters.items()):
        value[...] = k % 100
        views[name][...] = value
        assert views[name].shape == value.shape
        assert views[name].dtype == value.dtype
        assert np.shares_memory(views[name], flat)
    for k, name in enumerate(parameters):
        assert np.all(views[name] == k % 100)  # no view overlaps another


def test_version_marker_catches_a_version_mixing_two_steps() -> None:
    """The check the consistency tests rely on: one parameter of another step, or one element of a
    parameter, makes it fail; bfloat16 markers are read from their bits."""
    spec, dtypes, layout = small_model()
    parameters = ws.host_parameters(spec)
    ws.fill_marker(parameters, dtypes, 7)
    assert ws.version_marker(parameters, layout) == ws.marker(7)
    bf16 = next(name for name, dtype, _ in spec if dtype == "bfloat16")
    assert parameters[bf16].flat[0] == 0x4100  # 8.0 in bfloat16
    last = layout.specs[-1].name
    parameters[last].flat[-1] = ws.marker(6)
    with pytest.raises(AssertionError, match="several steps"):
        ws.version_marker(parameters, layout)
    ws.fill_marker({last: parameters[last]}, dtypes, 5)
    with pytest.raises(AssertionError, match="first parameter"):
        ws.version_marker(parameters, layout)


@pytest.mark.parametrize(("options", "message"), [({"slots": 1}, "slots"), ({"device": "tpu"}, "device")])
def test_weight_publisher_refuses_bad_options(
    socket_path: str, options: dict[str, Any], message: str
) -> None:
    _, _, layout = small_model()
    with aib.Publisher(socket_path) as publisher, pytest.raises(ValueError, match=message):
        ws.WeightPublisher(publisher, "w", layout, **options)


# ---------- the slot rule, in one process -----------------------------------------------------------------


def _wait_free(weights: ws.WeightPublisher, count: int) -> None:
    deadline = time.monotonic() + SOON
    while weights.free_slots() < count:
        assert time.monotonic() < deadline, f"{weights.free_slots()} slots free, expected {count}"
        time.sleep(0.005)


def test_a_held_version_is_never_written_and_publishing_waits_for_its_release(socket_path: str) -> None:
    spec, dtypes, layout = small_model()
    parameters = ws.host_parameters(spec)
    with aib.Publisher(socket_path) as publisher, aib.connect(socket_path, timeout=10.0) as session:
        weights = ws.WeightPublisher(publisher, "w", layout, slots=2)
        follower = ws.WeightFollower(session, "w")
        ws.fill_marker(parameters, dtypes, 1)
        weights.publish(parameters)
        held = follower.next(timeout=SOON)  # slot 0, held
        assert ws.version_marker(held.tensors, layout) == ws.marker(1)

        ws.fill_marker(parameters, dtypes, 2)
        weights.publish(parameters)  # slot 1: slot 0 is held
        ws.fill_marker(parameters, dtypes, 3)
        with pytest.raises(ws.SlotsBusyError, match="still hold"):
            weights.publish(parameters, timeout=0.3)  # slot 0 held by `held`, slot 1 published
        assert ws.version_marker(held.tensors, layout) == ws.marker(1)  # untouched meanwhile

        newer = follower.next(timeout=SOON)  # version of step 2, then the old one goes
        assert ws.version_marker(newer.tensors, layout) == ws.marker(2)
        held.release()
        _wait_free(weights, 1)
        version = weights.publish(parameters, timeout=SOON)  # slot 0 again
        latest = follower.next(timeout=SOON)
        assert latest.version == version
        assert ws.version_marker(latest.tensors, layout) == ws.marker(3)
        assert ws.version_marker(newer.tensors, layout) == ws.marker(2)  # slot 1 held: untouched
        newer.release()
        latest.release()
        weights.close()


def test_a_view_kept_after_release_keeps_its_slot_held(socket_path: str) -> None:
    """The lease lives as long as any view of the version: a consumer that keeps one parameter keeps
    the whole slot out of the trainer's reach (and the trainer says so)."""
    spec, _, layout = small_model()
    parameters = ws.host_parameters(spec)
    with aib.Publisher(socket_path) as publisher, aib.connect(socket_path, timeout=10.0) as session:
        weights = ws.WeightPublisher(publisher, "w", layout, slots=2)
        follower = ws.WeightFollower(session, "w")
        weights.publish(parameters)
        first = follower.next(timeout=SOON)
        kept = first.tensors[layout.specs[0].name]
        first.release()
        weights.publish(parameters)
        follower.next(timeout=SOON).release()
        with pytest.raises(ws.SlotsBusyError):
            weights.publish(parameters, timeout=0.3)
        del kept
        weights.publish(parameters, timeout=SOON)
        weights.close()


def _mapping_path(address: int) -> str:
    """The file behind ``address`` in this process (``/proc/self/maps``), or ``""``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else ""
    return ""


def test_host_parameters_are_the_producers_shared_memory(socket_path: str) -> None:
    """Zero-copy on the host: nothing copied on publish, every consumer view lies in the slot's
    memfd, and a write through the producer's slot shows in the consumer's view."""
    spec, dtypes, layout = small_model()
    parameters = ws.host_parameters(spec)
    with aib.Publisher(socket_path) as publisher, aib.connect(socket_path, timeout=10.0) as session:
        weights = ws.WeightPublisher(publisher, "w", layout, slots=2)
        follower = ws.WeightFollower(session, "w")
        before = aib.stats().host
        ws.fill_marker(parameters, dtypes, 4)
        weights.publish(parameters)
        assert aib.stats().host.copied_bytes == before.copied_bytes
        assert aib.stats().host.zero_copy_bytes - before.zero_copy_bytes == layout.total_bytes
        version = follower.next(timeout=SOON)
        for name, view in version.tensors.items():
            assert not view.flags.writeable
            assert _mapping_path(view.ctypes.data).startswith("/memfd:w-slot0"), name
        first = layout.specs[0]
        weights._views[0][first.name].flat[0] += 1  # the producer's slot, written behind the rule
        assert version.tensors[first.name].flat[0] == parameters[first.name].flat[0] + 1
        version.release()
        weights.close()


# ---------- two processes, many fast steps ----------------------------------------------------------------


def _follow_child(path: str, last_marker: int, report: Any) -> None:
    """Follow "w" to ``last_marker``, checking every version whole; report what was seen."""
    try:
        with aib.connect(path, timeout=SOON, wait_for_publisher=True) as session:
            follower = ws.WeightFollower(session, "w")
            model = ws.InferenceModel()
            mappings: set[str] = set()

            def note(version: ws.WeightVersion) -> None:
                first = next(iter(version.tensors.values()))
                if not mappings:
                    report.send(("ready",))  # the trainer goes on at full speed from here
                mappings.add(_mapping_path(first.ctypes.data).split(" ")[0])

            seen = ws.follow(follower, model, last_marker, timeout=SOON, on_version=note)
            model.close()
        report.send(("ok", seen, sorted(mappings)))
    except BaseException as exc:  # the parent's assertion shows it
        report.send(("error", repr(exc), []))


@pytest.mark.parametrize("slots", [2, 3])
def test_many_fast_steps_every_version_whole(socket_path: str, slots: int) -> None:
    """The trainer publishes as fast as its slots allow (no lockstep) while the consumer reads and
    checks every element of each version it gets: every one is whole, and markers only increase."""
    steps = 150
    spec, dtypes, layout = small_model(2 << 20, 60)
    parameters = ws.host_parameters(spec)
    parent, child_end = SPAWN.Pipe(duplex=False)
    with aib.Publisher(socket_path) as publisher:
        weights = ws.WeightPublisher(publisher, "w", layout, slots=slots)
        child = SPAWN.Process(target=_follow_child, args=(socket_path, ws.marker(steps - 1), child_end))
        child.start()
        try:
            for step in range(steps):
                ws.fill_marker(parameters, dtypes, step)
                weights.publish(parameters, timeout=SOON)
                if step == 0:  # a consumer that follows from the first version on
                    assert parent.poll(60), "the consumer did not start"
                    assert parent.recv() == ("ready",)
            assert parent.poll(60), "the consumer did not finish"
            status, seen, mappings = parent.recv()
        finally:
            child.join(30)
            if child.is_alive():
                child.terminate()
                child.join()
        weights.close()
    assert status == "ok", seen
    assert len(seen) >= 3
    assert seen == sorted(set(seen))
    assert seen[-1] == ws.marker(steps - 1)
    assert set(mappings) <= {f"/memfd:w-slot{k}" for k in range(slots)}, mappings
    assert child.exitcode == 0


def test_the_example_runs_as_a_user_runs_it() -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    with tempfile.TemporaryDirectory() as tmp:
        env["TMPDIR"] = tmp
        done = subprocess.run(
            [sys.executable, str(REPO / "examples" / "weight_sync.py"), "--steps", "25", "--tensors", "90"],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert os.listdir(tmp) == []  # the socket's directory is gone
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(
        line.startswith("trainer: published 25 versions of 90 parameters")
        and line.endswith(" 0 bytes copied by the bridge")
        for line in lines
    ), lines
    inference = [line for line in lines if line.startswith("inference: ")]
    assert len(inference) == 1
    assert "each whole (90 parameters at one step)" in inference[0], lines


# ---------- GPU: PyTorch with CUDA --------------------------------------------------------------------------


def _torch_cuda() -> Any:
    torch = pytest.importorskip("torch", reason="the CUDA weight sync uses PyTorch (pip install torch)")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch was built without CUDA or sees no GPU")
    return torch


def _cuda_parameters(torch: Any, spec: list[Any]) -> dict[str, Any]:
    return {
        name: torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda:0") for name, dtype, shape in spec
    }


@pytest.mark.gpu
def test_gpu_a_held_version_is_never_written(cuda_device: int, socket_path: str) -> None:
    torch = _torch_cuda()
    spec, dtypes, layout = small_model(4 << 20, 60)
    parameters = _cuda_parameters(torch, spec)
    with aib.Publisher(socket_path) as publisher, aib.connect(socket_path, timeout=10.0) as session:
        weights = ws.WeightPublisher(publisher, "w", layout, device="cuda", slots=2)
        follower = ws.WeightFollower(session, "w", like="torch")
        copied = aib.stats().cuda.copied_bytes
        ws.fill_marker(parameters, dtypes, 1)
        weights.publish(parameters)
        held = follower.next(timeout=SOON)
        assert all(t.is_cuda for t in held.tensors.values())
        assert {str(t.dtype) for t in held.tensors.values()} >= {"torch.bfloat16", "torch.int64"}
        ws.fill_marker(parameters, dtypes, 2)
        weights.publish(parameters)
        ws.fill_marker(parameters, dtypes, 3)
        with pytest.raises(ws.SlotsBusyError):
            weights.publish(parameters, timeout=0.3)
        assert ws.version_marker(held.tensors, layout) == ws.marker(1)
        newer = follower.next(timeout=SOON)
        assert ws.version_marker(newer.tensors, layout) == ws.marker(2)
        torch.cuda.current_stream().synchronize()  # the consumer's reads of `held` are done
        held.release()
        _wait_free(weights, 1)
        weights.publish(parameters, timeout=SOON)
        latest = follower.next(timeout=SOON)
        assert ws.version_marker(latest.tensors, layout) == ws.marker(3)
        assert ws.version_marker(newer.tensors, layout) == ws.marker(2)
        assert aib.stats().cuda.copied_bytes == copied
        newer.release()
        latest.release()
        weights.close()


def _gpu_follow_child(path: str, last_marker: int, report: Any) -> None:
    try:
        with aib.connect(path, timeout=SOON, wait_for_publisher=True) as session:
            follower = ws.WeightFollower(session, "w", like="torch")
            model = ws.InferenceModel()
            started: list[int] = []

            def note(version: ws.WeightVersion) -> None:
                if not started:
                    started.append(version.version)
                    report.send(("ready",))  # the trainer goes on at full speed from here

            seen = ws.follow(follower, model, last_marker, timeout=SOON, on_version=note)
            model.close()
        report.send(("ok", seen))
    except BaseException as exc:
        report.send(("error", repr(exc)))


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [2, 3])
def test_gpu_many_fast_steps_every_version_whole(cuda_device: int, socket_path: str, slots: int) -> None:
    torch = _torch_cuda()
    steps = 180  # under ws.MARKERS: markers then only increase
    spec, dtypes, layout = small_model(64 << 20, 300)
    parameters = _cuda_parameters(torch, spec)
    parent, child_end = SPAWN.Pipe(duplex=False)
    with aib.Publisher(socket_path) as publisher:
        weights = ws.WeightPublisher(publisher, "w", layout, device="cuda", slots=slots)
        child = SPAWN.Process(target=_gpu_follow_child, args=(socket_path, ws.marker(steps - 1), child_end))
        child.start()
        try:
            for step in range(steps):
                ws.fill_marker(parameters, dtypes, step)  # queued: the publish's event orders reads after it
                weights.publish(parameters, timeout=60)
                if step == 0:
                    assert parent.poll(120), "the consumer did not start"
                    assert parent.recv() == ("ready",)
            assert parent.poll(120), "the consumer did not finish"
            status, seen = parent.recv()
        finally:
            child.join(60)
            if child.is_alive():
                child.terminate()
                child.join()
        weights.close()
    assert status == "ok", seen
    assert len(seen) >= 3
    assert seen == sorted(set(seen))
    assert seen[-1] == ws.marker(steps - 1)


@pytest.mark.gpu
def test_gpu_example_runs(cuda_device: int) -> None:
    _torch_cuda()
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "weight_sync.py"), "--device", "cuda", "--steps", "30"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        ),
    )
    assert done.returncode == 0, done.stderr
    assert "parameters viewed in place on the GPU" in done.stdout, done.stdout
    assert "0 bytes copied by the bridge" in done.stdout, done.stdout


def test_the_benchmark_runs_on_the_host_and_reports_every_step(tmp_path: Path) -> None:
    """The harness of benchmarks/bench_weight_sync.py (its GPU run is the issue's benchmark): on the
    host it runs the bridge alone, checks every version, and reports one sample per step."""
    out = tmp_path / "ws.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_weight_sync.py"),
            "--device",
            "cpu",
            "--total-mib",
            "4",
            "--tensors",
            "60",
            "--steps",
            "8",
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        ),
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["method"] == "bridge"
    assert len(row["samples_ms"]) == 8
    assert all(sample > 0 for sample in row["samples_ms"])
    assert row["copied_bytes"] == 0
    assert {skip["method"] for skip in report["skipped"]} == {"torch_tensors", "torch_packed"}
    assert "skipped torch_packed" in done.stdout
