"""``python -m arrow_ipc_bridge``: demo, doctor, inspect.

``demo`` is the main job of the README: a producer process publishes a table and a consumer process
imports it and reports what it got and how long it took.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _demo_table(rows: int, columns: int) -> Any:
    import pyarrow as pa

    return pa.table({f"c{i}": pa.array([float(i)] * rows, pa.float64()) for i in range(columns)})


def _zero_copy_table(rows: int, columns: int, directory: str) -> Any:
    """The demo table written as an Arrow IPC file in shared memory and memory-mapped back, so its
    columns already live in a file another process can map: exported with no copy at all."""
    import pyarrow as pa

    table = _demo_table(rows, columns)
    path = os.path.join(directory, "demo-table.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def _gpu_present() -> bool:
    from arrow_ipc_bridge import cuda

    return cuda.driver_available() and cuda.device_count() > 0


def _run_producer(socket_path: str, rows: int, columns: int, shm_dir: str) -> int:
    import arrow_ipc_bridge as aib

    with aib.Publisher(socket_path) as pub:
        table = _demo_table(rows, columns)
        if _gpu_present():
            # Published once and fetched many times: cuMemAlloc memory, whose message the consumer's
            # session remembers from the first get without keeping a lease (the IPC pool, to_device's
            # default, is kept from the second get on, with a lease: it suits data that changes often).
            gpu = pub.publish("gpu", aib.to_device(table, allocation="legacy"))
            where = (
                f"'gpu' ({gpu.regions} region of cuMemAlloc memory shared by a CUDA IPC handle, "
                f"{gpu.copied_bytes} bytes copied)"
            )
        else:
            where = "no GPU table (no CUDA GPU here)"
        copied = pub.publish("copied", table)
        zero = pub.publish("zero_copy", _zero_copy_table(rows, columns, shm_dir))
        print(
            f"producer pid {os.getpid()}: published {where}, 'copied' "
            f"({copied.copied_bytes / 2**20:.1f} MiB copied once into a sealed memfd) and 'zero_copy' "
            f"({zero.copied_bytes} bytes copied, {zero.zero_copy_regions} zero-copy region)",
            flush=True,
        )
        sys.stdin.readline()  # the parent closes our stdin when the consumer is done
    return 0


def _timed_gets(session: Any, name: str, use: Any, repeat: int = 20) -> list[float]:
    timings = []
    for _ in range(repeat):
        start = time.perf_counter()
        with session.get(name) as imported:
            use(imported)
            timings.append(time.perf_counter() - start)
    return sorted(timings)


def _run_consumer(socket_path: str) -> int:
    import pyarrow as pa
    import pyarrow.compute as pc

    import arrow_ipc_bridge as aib

    with aib.connect(socket_path, timeout=10.0) as session:
        names = session.list()
        print(f"consumer pid {os.getpid()}: publisher serves {names}", flush=True)
        if "gpu" in names:
            # What a device-aware consumer (cuDF, CuPy) does: take the device array capsule.
            timings = _timed_gets(session, "gpu", lambda imported: imported.__arrow_c_device_stream__())
            with session.get("gpu") as imported:
                host = imported.to_host()  # checking the values, outside the timing
                device = f"CUDA device {imported.device_id}"
            total = pc.sum(host.column(host.num_columns - 1)).as_py()
            print(
                f"  gpu      : {host.nbytes / 2**20:.1f} MiB on {device}, {len(timings)} gets, median "
                f"{timings[len(timings) // 2] * 1e6:.0f} us from request to a device stream capsule "
                f"(best {timings[0] * 1e6:.0f} us); last column sums to {total}",
                flush=True,
            )
        for name in ("copied", "zero_copy"):
            timings = _timed_gets(session, name, pa.table)
            with session.get(name) as imported:
                table = pa.table(imported)
                total = pc.sum(table.column(table.num_columns - 1)).as_py()
                nbytes = table.nbytes
                del table
            print(
                f"  {name:9s}: {nbytes / 2**20:.1f} MiB in host shared memory, {len(timings)} gets, median "
                f"{timings[len(timings) // 2] * 1e6:.0f} us from request to pyarrow table "
                f"(best {timings[0] * 1e6:.0f} us); last column sums to {total}",
                flush=True,
            )
    return 0


def demo(rows: int, columns: int) -> int:
    """Run a producer and a consumer process sharing a table; print what happened."""
    if _gpu_present():
        print("CUDA GPU found: sharing the table on the GPU (and through host shared memory)")
    else:
        print("no CUDA GPU here: sharing the table through host shared memory")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as shm_dir, tempfile.TemporaryDirectory(dir="/tmp") as sock_dir:
        socket_path = os.path.join(sock_dir, "demo.sock")
        producer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "arrow_ipc_bridge",
                "_producer",
                socket_path,
                str(rows),
                str(columns),
                shm_dir,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert producer.stdout is not None
            ready = producer.stdout.readline()  # printed once both tables are published
            if not ready:
                print("the producer did not start", file=sys.stderr)
                return 1
            print(ready, end="", flush=True)
            consumer = subprocess.run(
                [sys.executable, "-m", "arrow_ipc_bridge", "_consumer", socket_path], check=False
            )
        finally:
            if producer.stdin is not None:
                producer.stdin.close()
            producer.wait(timeout=30)
    return consumer.returncode or producer.returncode


def doctor() -> int:
    """Print what this machine supports."""
    import pyarrow as pa

    from arrow_ipc_bridge import __version__, cuda
    from arrow_ipc_bridge._ffi import WIRE_VERSION

    print(
        f"arrow_ipc_bridge {__version__}, wire format {WIRE_VERSION[0]}.{WIRE_VERSION[1]}, "
        f"pyarrow {pa.__version__}"
    )
    print(
        f"python {sys.version.split()[0]}, /dev/shm {'present' if os.path.isdir('/dev/shm') else 'missing'}"
    )
    if cuda.driver_available():
        count = cuda.device_count()
        print(f"CUDA driver present, {count} device(s)")
        for i in range(count):
            print(f"  {i}: {cuda.device_name(i)} uuid {cuda.device_uuid(i).hex()}")
    else:
        print("CUDA driver: not found (host memory only)")
    return 0


def inspect(path: str, n_fds: int) -> int:
    """Decode a message file and print what it holds (validation errors are printed, exit 1)."""
    import pyarrow as pa

    from arrow_ipc_bridge.capsules import new_capsule
    from arrow_ipc_bridge.errors import WireFormatError
    from arrow_ipc_bridge.metadata import Decoded

    data = Path(path).read_bytes()
    try:
        decoded = Decoded(data, n_fds)
    except WireFormatError as exc:
        print(f"invalid: {exc}")
        return 1
    capsule, schema = new_capsule("schema")
    decoded.rebuild_schema(schema)
    kind = "stream" if decoded.is_stream else "array"
    print(
        f"{len(data)} bytes, wire {data[4]}.{data[5]}, {kind}, {decoded.batch_count} batch(es), "
        f"{decoded.node_count} schema nodes"
    )
    print(f"device: {decoded.device()}")
    for i, region in enumerate(decoded.regions()):
        print(f"region {i}: {region}")
    print(pa.Schema._import_from_c_capsule(capsule))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arrow_ipc_bridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="a producer and a consumer process sharing a table")
    p_demo.add_argument("--rows", type=int, default=1_000_000)
    p_demo.add_argument("--columns", type=int, default=16)
    sub.add_parser("doctor", help="what this machine supports")
    p_inspect = sub.add_parser("inspect", help="decode and print a message file")
    p_inspect.add_argument("path")
    p_inspect.add_argument("--fds", type=int, default=1, help="how many fds travelled with it")
    p_prod = sub.add_parser("_producer")
    p_prod.add_argument("socket")
    p_prod.add_argument("rows", type=int)
    p_prod.add_argument("columns", type=int)
    p_prod.add_argument("shm_dir")
    p_cons = sub.add_parser("_consumer")
    p_cons.add_argument("socket")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args.rows, args.columns)
    if args.command == "doctor":
        return doctor()
    if args.command == "inspect":
        return inspect(args.path, args.fds)
    if args.command == "_producer":
        return _run_producer(args.socket, args.rows, args.columns, args.shm_dir)
    return _run_consumer(args.socket)
