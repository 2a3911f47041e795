"""``bench``'s two processes, a producer and a consumer started with ``spawn`` (nothing inherited
by a fork, CUDA included), and the parent's side of them.

The consumer drives: for each case of the plan it tells the producer to set the case up, takes the
warm-up and timed samples (``_bench_cases`` says what one is), tells the producer the case is over,
and sends its samples to the parent. The producer answers on a control connection (a
``multiprocessing`` Pipe) and serves the bridge on a ``Publisher``; each peer has a channel of its
own, made by the parent and handed to both. Each child reports to the parent on a pipe of its own:
the case it starts, the samples of each case, ``done``, or the error that stopped it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from arrow_ipc_bridge.cli._bench_cases import (
    ConsumerLinks,
    ProducerLinks,
    Shape,
    consumer_case,
    producer_case,
)
from arrow_ipc_bridge.cli._bench_options import format_size
from arrow_ipc_bridge.cli._output import CommandError

__all__ = ["PlanItem", "run_pair"]

_CONNECT_TIMEOUT_S = 120.0  # the consumer waits this long for the producer's publisher (spawn, imports)
_JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PlanItem:
    """One case at one size on one device: what the consumer runs, in plan order."""

    case: str
    size: int
    shape: Shape


# ---------- the children ----------------------------------------------------------------------------
def _as_socket(connection: Any) -> socket.socket:
    """A duplex ``multiprocessing`` Pipe is a socket pair on Linux: the IPC peer uses its end as a
    plain socket, so the bytes move with ``sendall`` / ``recv_into`` and nothing of Pipe's framing."""
    sock = socket.socket(fileno=os.dup(connection.fileno()))
    connection.close()
    return sock


def _report_failure(results: Any, side: str) -> None:
    """The exception being handled, as the one line the parent prints: its type, message and the
    line that raised it."""
    exc = sys.exc_info()[1]
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    at = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    with contextlib.suppress(OSError, ValueError):
        results.send(("error", f"{side}: {text}{at}"))


def producer_main(
    *, socket_path: str, control: Any, pickle_pipe: Any, ipc_end: Any, torch_queue: Any, results: Any
) -> None:
    """The producer process: publish and answer the consumer until it says ``quit``."""
    try:
        import arrow_ipc_bridge as aib

        with aib.Publisher(socket_path) as publisher:
            links = ProducerLinks(publisher, control, pickle_pipe, _as_socket(ipc_end), torch_queue)
            _serve(links)
        results.send(("done",))
    except BaseException:
        _report_failure(results, "producer")
        raise SystemExit(1) from None


def _serve(links: ProducerLinks) -> None:
    case = None
    while True:
        message = links.control.recv()
        kind = message[0]
        if kind == "start":
            _, name, shape = message
            case = producer_case(name, links, shape)
            links.control.send(("ready",))
        elif kind == "prepare" and case is not None:
            case.prepare(message[1])
            links.control.send(("prepared", message[1]))
        elif kind == "go" and case is not None:
            case.hand_off(message[1])
        elif kind == "end" and case is not None:
            case.close()
            case = None
            links.control.send(("ended",))
        elif kind == "quit":
            return
        else:
            raise RuntimeError(f"unexpected request from the consumer: {message!r}")


def consumer_main(
    *,
    socket_path: str,
    plan: Sequence[PlanItem],
    warmup: int,
    repeats: int,
    control: Any,
    pickle_pipe: Any,
    ipc_end: Any,
    torch_queue: Any,
    results: Any,
) -> None:
    """The consumer process: run the plan's cases in order, sending each one's samples."""
    try:
        import arrow_ipc_bridge as aib

        with aib.connect(socket_path, timeout=_CONNECT_TIMEOUT_S, wait_for_publisher=True) as session:
            links = ConsumerLinks(session, control, pickle_pipe, _as_socket(ipc_end), torch_queue)
            for index, item in enumerate(plan):
                results.send(("start", index))
                results.send(("case", index, _run_case(links, item, warmup + repeats)))
            control.send(("quit",))
        results.send(("done",))
    except BaseException:
        _report_failure(results, "consumer")
        raise SystemExit(1) from None


def _expect(control: Any, answer: tuple[Any, ...]) -> None:
    got = control.recv()
    if got != answer:
        raise RuntimeError(f"the producer answered {got!r}, expected {answer!r}")


def _run_case(links: ConsumerLinks, item: PlanItem, samples: int) -> list[float]:
    """Every sample of one case, in seconds, warm-ups first."""
    control = links.control
    control.send(("start", item.case, item.shape))
    _expect(control, ("ready",))
    side = consumer_case(item.case, links, item.shape)
    timings: list[float] = []
    try:
        for step in range(1, samples + 1):
            control.send(("prepare", step))
            _expect(control, ("prepared", step))
            start = time.perf_counter()
            value = side.fetch(step)
            timings.append(time.perf_counter() - start)
            side.release()
            if value != side.expected(step):
                raise RuntimeError(
                    f"sample {step} read {value}, expected {side.expected(step)}: the data moved is not "
                    "what the producer wrote"
                )
    finally:
        side.release()
        side.close()
    control.send(("end",))
    _expect(control, ("ended",))
    return timings


# ---------- the parent ------------------------------------------------------------------------------
def run_pair(
    plan: Sequence[PlanItem],
    *,
    warmup: int,
    repeats: int,
    on_case: Callable[[int, list[float]], None],
    stall_s: float = 600.0,
) -> None:
    """Run ``plan`` in a producer and a consumer process; ``on_case(index, samples)`` as each case
    ends (samples in seconds, ``warmup`` warm-ups then ``repeats`` timed ones).

    Raises :class:`CommandError` naming the case when a process fails, dies, or reports nothing for
    ``stall_s`` seconds; both processes are ended before it returns or raises.
    """
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="aib-bench-", dir="/tmp") as directory:
        socket_path = os.path.join(directory, "bench.sock")
        control = context.Pipe()
        pickle_pipe = context.Pipe()
        ipc = context.Pipe()
        # a plain spawn Queue: torch.multiprocessing's Queue is this class, and each side imports
        # torch.multiprocessing (registering its reductions) before it puts or gets a tensor
        torch_queue = context.Queue() if any(item.case == "torch" for item in plan) else None
        producer_results, producer_reports = context.Pipe(duplex=False)
        consumer_results, consumer_reports = context.Pipe(duplex=False)
        producer = context.Process(
            target=producer_main,
            kwargs={
                "socket_path": socket_path,
                "control": control[0],
                "pickle_pipe": pickle_pipe[0],
                "ipc_end": ipc[0],
                "torch_queue": torch_queue,
                "results": producer_reports,
            },
            name="aib-bench-producer",
            daemon=True,
        )
        consumer = context.Process(
            target=consumer_main,
            kwargs={
                "socket_path": socket_path,
                "plan": list(plan),
                "warmup": warmup,
                "repeats": repeats,
                "control": control[1],
                "pickle_pipe": pickle_pipe[1],
                "ipc_end": ipc[1],
                "torch_queue": torch_queue,
                "results": consumer_reports,
            },
            name="aib-bench-consumer",
            daemon=True,
        )
        processes = {"producer": producer, "consumer": consumer}
        finished = False
        try:
            for process in processes.values():
                process.start()
            # the children hold their ends now: the parent's copies would hide a child's exit
            for end in (*control, *pickle_pipe, *ipc, producer_reports, consumer_reports):
                end.close()
            _follow(
                plan,
                processes,
                {"producer": producer_results, "consumer": consumer_results},
                on_case,
                stall_s,
            )
            finished = True
        finally:
            for process in processes.values():
                if process.pid is None:
                    continue
                process.join(_JOIN_TIMEOUT_S if finished else 0)
                if process.is_alive():
                    process.kill()
                    process.join()
            if torch_queue is not None:
                torch_queue.close()
                torch_queue.join_thread()
        for name, process in processes.items():
            if process.exitcode != 0:
                raise CommandError(f"the {name} process exited with status {process.exitcode} at its end")


def _follow(
    plan: Sequence[PlanItem],
    processes: dict[str, Any],
    results: dict[str, Any],
    on_case: Callable[[int, list[float]], None],
    stall_s: float,
) -> None:
    """Read both children's reports until both are done."""
    current = 0  # the case the consumer is on: what an error is about

    def where() -> str:
        if current >= len(plan):
            return "after the last case"
        item = plan[current]
        return f"in case {item.case} ({item.shape.device}, {format_size(item.size)})"

    open_results = dict(results)
    done: set[str] = set()
    last_report = time.monotonic()
    while len(done) < len(processes):
        waiting = [*open_results.values(), *(p.sentinel for n, p in processes.items() if n not in done)]
        ready = multiprocessing.connection.wait(waiting, timeout=5.0)
        if not ready and time.monotonic() - last_report > stall_s:
            raise CommandError(f"no progress for {stall_s:.0f} s {where()}: stopped")
        for name, connection in list(open_results.items()):
            while name in open_results and connection.poll():
                try:
                    report = connection.recv()
                except EOFError:
                    del open_results[name]
                    break
                last_report = time.monotonic()
                if report[0] == "error":
                    raise CommandError(f"{where()}: {report[1]}")
                if report[0] == "start":
                    current = report[1]
                elif report[0] == "case":
                    on_case(report[1], report[2])
                    current = report[1] + 1
                elif report[0] == "done":
                    done.add(name)
        for name, process in processes.items():
            if name not in done and name not in open_results and process.exitcode is None:
                process.join(_JOIN_TIMEOUT_S)  # its reports ended: it is exiting
            drained = name not in open_results or not open_results[name].poll()
            if name not in done and process.exitcode is not None and drained:
                raise CommandError(f"the {name} process exited with status {process.exitcode} {where()}")
