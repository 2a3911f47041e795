"""``bench``'s two processes: the command's own process is the producer, a consumer is spawned
(``spawn``: nothing inherited by a fork, CUDA included).

The producer publishes every case's columns before the consumer starts (on the host it also writes
them as an Arrow IPC file, the peer) and then only answers: a ``("go", case, step)`` from the
consumer puts that case's tensors on the torch queue (the GPU peer). The consumer takes, for each
case in turn, the warm-up and timed samples of every method of the case in alternation (bridge,
peer, bridge, peer, ...), so that a drift of the machine falls on both alike, and reports each
case's samples on the same pipe; ``_bench_steps`` times each operation. Every value read is checked
against the one the producer wrote, so a method that moved other data fails.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from arrow_ipc_bridge.cli._output import CommandError

__all__ = [
    "COLUMNS",
    "LABELS",
    "Case",
    "describe",
    "expected_value",
    "format_size",
    "run_pair",
    "take_samples",
]

COLUMNS: Final = 16  # float64 columns, as in the project's published figures
LABELS: Final = {
    "bridge": "bridge re-get",
    "ipc_file": "Arrow IPC file, memory_map",
    "torch": "torch.multiprocessing Queue",
}
_JOIN_TIMEOUT_S = 30.0
Step = Callable[[int], tuple[float, float]]  # a step number -> (seconds, the value read)


@dataclass(frozen=True)
class Case:
    """One device and size: the bridge and its peer moving the same ``COLUMNS`` float64 columns of
    ``size`` bytes in all. ``methods`` are keys of ``LABELS``, the bridge first."""

    device: str  # "host", or "cuda" (GPU 0)
    size: int
    methods: tuple[str, ...]

    @property
    def rows(self) -> int:
        return self.size // (COLUMNS * 8)

    @property
    def name(self) -> str:
        return f"{self.device}-{self.size}"


def expected_value(index: int) -> float:
    """What every value of case ``index``'s columns is: a different one per case, so that a method
    reading another case's data fails."""
    return index + 0.5


def format_size(nbytes: int) -> str:
    """A size as ``--sizes`` spells it: ``64MiB``, ``1.5MiB``, ``100B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


def describe(case: Case) -> str:
    """``host 64MiB``: how progress lines and errors name a case."""
    return f"{case.device} {format_size(case.size)}"


# ---------- the producer (this process) -----------------------------------------------------------
def _publish(
    publisher: Any, cases: Sequence[Case], directory: str
) -> tuple[list[str | None], dict[int, Any]]:
    """Publish each case's columns under its name with the default options; write the host cases'
    IPC files in ``directory``. Returns the file paths (None for GPU cases) and the GPU cases' torch
    tensors by case index (the torch peer sends them; the publication keeps them alive too)."""
    import pyarrow as pa

    import arrow_ipc_bridge as aib

    names = [f"c{i:02d}" for i in range(COLUMNS)]
    paths: list[str | None] = []
    tensors: dict[int, Any] = {}
    for index, case in enumerate(cases):
        value = expected_value(index)
        if case.device == "host":
            # a separate buffer per column: the columns are COLUMNS distinct regions of memory
            table = pa.table({name: pa.repeat(pa.scalar(value, pa.float64()), case.rows) for name in names})
            publisher.publish(case.name, table)
            path = os.path.join(directory, f"{case.name}.arrow")
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
            paths.append(path)
            continue
        torch = importlib.import_module("torch")
        importlib.import_module("torch.multiprocessing")  # its reductions share CUDA tensors by IPC
        columns = [torch.full((case.rows,), value, dtype=torch.float64, device="cuda:0") for _ in names]
        torch.cuda.synchronize(0)
        publisher.publish(case.name, aib.from_cuda_arrays(dict(zip(names, columns, strict=True))))
        tensors[index] = columns
        paths.append(None)
    return paths, tensors


def run_pair(
    cases: Sequence[Case],
    *,
    warmup: int,
    repeats: int,
    on_case: Callable[[int, dict[str, list[float]]], None],
    stall_s: float = 600.0,
) -> None:
    """Publish ``cases``, run the consumer, and call ``on_case(index, samples)`` as each case ends
    (``samples``: seconds by method, ``warmup`` warm-ups then ``repeats`` timed ones).

    Raises :class:`CommandError` naming the case when the consumer fails, dies or reports nothing
    for ``stall_s`` seconds; the consumer is ended before this returns or raises."""
    import arrow_ipc_bridge as aib

    context = multiprocessing.get_context("spawn")
    # The peer's file lives in memory, as the bridge's data does, wherever the system has /dev/shm.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        # /tmp, not $TMPDIR: a long TMPDIR could push the socket's path past AF_UNIX's 108 bytes
        tempfile.TemporaryDirectory(prefix="aib-bench-", dir="/tmp") as sockets,
        tempfile.TemporaryDirectory(prefix="aib-bench-", dir=shm) as files,
    ):
        socket_path = os.path.join(sockets, "bench.sock")
        with aib.Publisher(socket_path) as publisher:
            paths, tensors = _publish(publisher, cases, files)
            torch_queue = context.Queue() if tensors else None
            ours, theirs = context.Pipe()
            consumer = context.Process(
                target=consumer_main,
                kwargs={
                    "socket_path": socket_path,
                    "cases": list(cases),
                    "paths": paths,
                    "samples": warmup + repeats,
                    "conn": theirs,
                    "torch_queue": torch_queue,
                },
                name="aib-bench-consumer",
                daemon=True,
            )
            finished = False
            try:
                consumer.start()
                theirs.close()  # the child holds its end now: ours sees EOF when it exits
                _serve(
                    cases,
                    consumer,
                    ours,
                    torch_queue=torch_queue,
                    tensors=tensors,
                    on_case=on_case,
                    stall_s=stall_s,
                )
                finished = True
            finally:
                ours.close()
                if consumer.pid is not None:
                    consumer.join(_JOIN_TIMEOUT_S if finished else 0)
                    if consumer.is_alive():
                        consumer.kill()
                        consumer.join()
                if torch_queue is not None:
                    torch_queue.close()
                    torch_queue.join_thread()
            if consumer.exitcode != 0:
                raise CommandError(f"the consumer process exited with status {consumer.exitcode} at its end")


def _serve(
    cases: Sequence[Case],
    consumer: Any,
    conn: Any,
    *,
    torch_queue: Any,
    tensors: Mapping[int, Any],
    on_case: Callable[[int, dict[str, list[float]]], None],
    stall_s: float,
) -> None:
    """Answer the consumer and pass its results on until it says ``done``."""
    current = 0  # the case the consumer is on: what an error is about

    def where() -> str:
        return f"in case {describe(cases[current])}" if current < len(cases) else "after the last case"

    last_report = time.monotonic()
    while True:
        ready = multiprocessing.connection.wait([conn, consumer.sentinel], timeout=5.0)
        if conn in ready:
            try:
                report = conn.recv()
            except EOFError:
                consumer.join(_JOIN_TIMEOUT_S)  # its end closed: it is exiting
                raise CommandError(
                    f"the consumer process exited with status {consumer.exitcode} {where()}"
                ) from None
            last_report = time.monotonic()
            if report[0] == "go":
                torch_queue.put((report[2], tensors[report[1]]))
            elif report[0] == "case":
                on_case(report[1], report[2])
                current = report[1] + 1
            elif report[0] == "error":
                raise CommandError(f"{where()}: {report[1]}")
            elif report[0] == "done":
                return
        elif consumer.sentinel in ready:
            raise CommandError(f"the consumer process exited with status {consumer.exitcode} {where()}")
        elif time.monotonic() - last_report > stall_s:
            raise CommandError(f"no progress for {stall_s:.0f} s {where()}: stopped")


# ---------- the consumer (the spawned process) ------------------------------------------------------
def _report_failure(conn: Any) -> None:
    """The exception being handled, as the one line the parent prints: its type, message and the
    line that raised it."""
    exc = sys.exc_info()[1]
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    at = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    with contextlib.suppress(OSError, ValueError):
        conn.send(("error", f"consumer: {text}{at}"))


def consumer_main(
    *,
    socket_path: str,
    cases: Sequence[Case],
    paths: Sequence[str | None],
    samples: int,
    conn: Any,
    torch_queue: Any,
) -> None:
    """Sample every case in order on a session with the default options, sending each one's
    samples."""
    try:
        import arrow_ipc_bridge as aib

        if torch_queue is not None:
            importlib.import_module("torch.multiprocessing")  # before the first get, outside the timing
        with aib.connect(socket_path) as session:
            for index, case in enumerate(cases):
                methods = _methods(
                    case, index, session, path=paths[index], conn=conn, torch_queue=torch_queue
                )
                conn.send(("case", index, take_samples(case, expected_value(index), methods, samples)))
        conn.send(("done",))
    except BaseException:
        _report_failure(conn)
        raise SystemExit(1) from None


def _methods(
    case: Case, index: int, session: Any, *, path: str | None, conn: Any, torch_queue: Any
) -> dict[str, Step]:
    """Case ``index``'s steps by method, each taking the step number."""
    from arrow_ipc_bridge.cli import _bench_steps as steps

    def bridge(step: int) -> tuple[float, float]:
        if case.device == "host":
            return steps.bridge_reget_host(session, case.name)
        return steps.bridge_reget_cuda(session, case.name)

    def ipc_file(step: int) -> tuple[float, float]:
        if path is None:
            raise RuntimeError(f"{describe(case)} has no IPC file: the Arrow IPC peer is for host cases")
        return steps.ipc_file_read(path)

    def ask(step: int) -> None:
        conn.send(("go", index, step))

    def torch(step: int) -> tuple[float, float]:
        return steps.torch_queue_get(ask, torch_queue, step)

    return {"bridge": bridge, "ipc_file": ipc_file, "torch": torch}


def take_samples(
    case: Case, expected: float, methods: Mapping[str, Step], samples: int
) -> dict[str, list[float]]:
    """``samples`` of each of ``case.methods`` in alternation, in seconds; ``RuntimeError`` when a
    method reads a value other than ``expected``."""
    taken: dict[str, list[float]] = {method: [] for method in case.methods}
    for step in range(samples):
        for method in case.methods:
            seconds, value = methods[method](step)
            if value != expected:
                raise RuntimeError(
                    f"{LABELS[method]} read {value}, expected {expected}: not the data the producer wrote"
                )
            taken[method].append(seconds)
    return taken
