"""``demo``: a producer process publishes a table and a consumer process imports it and reports
what it got and how long it took (the README's first command).

The two processes are this command line's hidden ``_producer`` and ``_consumer`` subcommands.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["demo", "run_consumer", "run_producer"]


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


def run_producer(socket_path: str, rows: int, columns: int, shm_dir: str) -> int:
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


def run_consumer(socket_path: str) -> int:
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
