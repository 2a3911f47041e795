"""Flight front throughput on loopback, against a plain pyarrow.flight server in the same run.

A spawned server process holds a table of 16 float32 columns (``--size``, default 1 GiB) three ways:
a plain ``pyarrow.flight`` server streaming it from memory (the peer), a publisher with the
bridge's Flight front (``arrow_ipc_bridge.flight.serve``), and, with ``--gpu``, the same table
uploaded to GPU 0 (``aib.to_device``) behind the same front. This process is the client: it times
``do_get(...).read_all()`` for each, alternating, and reports GiB/s and the ratio to the peer
(target: >= 0.9). With ``--gpu`` the server process also measures the machine's copy bandwidth in
the same run, between a device allocation and pinned host memory of the table's size (H2D
``cuMemcpyHtoD``, D2H ``cuMemcpyDtoHAsync`` as the front's staging copies), and the report compares
the GPU ``do_get`` with that D2H time + the peer's time (target: within 1.2x).

The same-host consumer given the Flight address (``aib.connect("grpc://...")`` takes the socket)
is timed against the bridge's own ``connect(path).get`` (target: within 1.2x): get, build a
``pyarrow.Table`` over the mapping, release. Both sessions are open together and timed in
alternating blocks (A/B, then B/A, over several rounds), so that load on the machine falls on both
alike; each reports median, p10, p90 and best, the route the Flight address took
(``session.route``), and which get path its timed gets went (``aib.stats()``: remembered gets
against Python imports and regions mapped), so that a gap between the two says where it comes from.

    python benchmarks/bench_flight.py                 # 1 GiB, 5 repeats
    python benchmarks/bench_flight.py --quick         # 64 MiB, 3 repeats
    python benchmarks/bench_flight.py --size 256MiB --repeat 7 --json out.json
    python benchmarks/bench_flight.py --gpu           # adds the GPU rows (CUDA GPU needed)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import pyarrow as pa
from pyarrow import flight

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
COLUMNS = 16


def parse_size(text: str) -> int:
    lowered = text.strip().lower()
    for unit, factor in _UNITS.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def make_table(nbytes: int, batch_rows: int) -> pa.Table:
    """16 float32 columns of ``nbytes`` in all, in batches of ``batch_rows`` rows."""
    import numpy as np

    rows = max(1, nbytes // (4 * COLUMNS))
    data = {f"c{i}": np.arange(rows, dtype=np.float32) + i for i in range(COLUMNS)}
    return pa.Table.from_batches(pa.table(data).to_batches(max_chunksize=batch_rows))


class PlainServer(flight.FlightServerBase):  # type: ignore[misc]
    """The peer: a table in memory, streamed as pyarrow.flight's own RecordBatchStream."""

    def __init__(self, location: str, table: pa.Table) -> None:
        super().__init__(location)
        self._table = table

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.RecordBatchStream:
        return flight.RecordBatchStream(self._table)


def server_main(nbytes: int, batch_rows: int, gpu: bool, sock_dir: str, out: Connection) -> None:
    """The server process: the peer, a publisher with the front, and (gpu) the device copy."""
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge.flight import serve

    table = make_table(nbytes, batch_rows)
    plain = PlainServer("grpc://127.0.0.1:0", table)
    pub = aib.Publisher(os.path.join(sock_dir, "bench.sock"))
    pub.publish("host", table)
    facts: dict[str, Any] = {"nbytes": table.nbytes, "batches": len(table.to_batches())}
    if gpu:
        device_table = aib.to_device(table, 0)
        pub.publish("gpu", device_table)
        facts.update(copy_bandwidth(table.nbytes))
    front = serve(pub, allow_unauthenticated=True)
    out.send(
        {"plain": f"grpc://127.0.0.1:{plain.port}", "front": front.location, "socket": pub.path, **facts}
    )
    out.recv()  # until the client is done
    front.close()
    plain.shutdown()
    pub.close()


def copy_bandwidth(nbytes: int, repeat: int = 3) -> dict[str, float]:
    """The best H2D and D2H seconds for ``nbytes`` between GPU 0 and pinned host memory, with the
    front's own copier (``cuMemcpyDtoHAsync`` on its stream) for D2H."""
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.flight.copier import CudaCopier

    copier = CudaCopier(0)
    host = copier.allocate(nbytes)
    device = cuda.mem_alloc(nbytes, 0)
    try:
        h2d, d2h = [], []
        for _ in range(repeat):
            started = time.perf_counter()
            cuda.memcpy_htod(device, host, nbytes, device=0)
            h2d.append(time.perf_counter() - started)
            started = time.perf_counter()
            copier.copy(host, device, nbytes)
            copier.wait(copier.fence())
            d2h.append(time.perf_counter() - started)
    finally:
        cuda.mem_free(device, device=0)
        copier.free(host)
        copier.close()
    return {"h2d_s": min(h2d), "d2h_s": min(d2h)}


def time_do_get(location: str, ticket: bytes, repeat: int) -> list[float]:
    client = flight.connect(location)
    times = []
    try:
        for _ in range(repeat):
            started = time.perf_counter()
            table = client.do_get(flight.Ticket(ticket)).read_all()
            times.append(time.perf_counter() - started)
            del table
    finally:
        client.close()
    return times


def _one_get(session: Any) -> float:
    """Seconds for one get + a ``pyarrow.Table`` over the mapping + release."""
    started = time.perf_counter()
    with session.get("host") as imported:
        table = pa.table(imported)
        del table
    return time.perf_counter() - started


_PATH_COUNTERS = ("remembered_gets", "new_message_gets", "python_imports", "regions_mapped", "bytes_mapped")


def _path_counters() -> dict[str, int]:
    """The process's counters that say which path a get went (steady state: remembered gets only)."""
    import arrow_ipc_bridge as aib

    stats = aib.stats()
    values = {**vars(stats.session), **vars(stats.host)}
    return {name: int(values[name]) for name in _PATH_COUNTERS}


def time_same_host_gets(addresses: dict[str, str], rounds: int, per_round: int) -> dict[str, Any]:
    """The same get through a session per address (all open together), in alternating blocks of
    ``per_round`` gets over ``rounds`` rounds (the order reversed every other round). Per address:
    the seconds of every get, its session's ``route`` and ``route_reason``, and the get-path
    counters its timed gets moved."""
    import arrow_ipc_bridge as aib

    sessions: dict[str, Any] = {}
    threads: dict[str, int] = {}
    try:
        for label, address in addresses.items():
            sessions[label] = aib.connect(address)
            threads[label] = len(os.listdir("/proc/self/task"))  # threads once connected
        for session in sessions.values():
            for _ in range(5):  # the first get maps the region; a few more settle the session
                _one_get(session)
        times: dict[str, list[float]] = {label: [] for label in sessions}
        counters = {label: dict.fromkeys(_PATH_COUNTERS, 0) for label in sessions}
        labels = list(sessions)
        for round_ in range(rounds):
            for label in labels if round_ % 2 == 0 else labels[::-1]:
                before = _path_counters()
                for _ in range(per_round):
                    times[label].append(_one_get(sessions[label]))
                after = _path_counters()
                for name in _PATH_COUNTERS:
                    counters[label][name] += after[name] - before[name]
        return {
            label: {
                "s": times[label],
                "route": getattr(session, "route", "?"),
                "route_reason": getattr(session, "route_reason", ""),
                "session_type": type(session).__name__,
                "threads_after_connect": threads[label],
                "counters": counters[label],
            }
            for label, session in sessions.items()
        }
    finally:
        for session in sessions.values():
            session.close()


def spread(samples: list[float]) -> dict[str, float]:
    """Median, p10, p90 and best of ``samples`` (seconds)."""
    ordered = sorted(samples)
    deciles = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
    return {"median": statistics.median(ordered), "p10": deciles[0], "p90": deciles[-1], "best": ordered[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="table size (16 float32 columns), e.g. 256MiB")
    parser.add_argument("--batch-rows", type=int, default=1 << 20, help="rows per record batch")
    parser.add_argument("--repeat", type=int, default=5, help="timed do_gets per server")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats")
    parser.add_argument("--gpu", action="store_true", help="add the GPU table (needs a CUDA GPU)")
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args()
    nbytes = parse_size("64MiB" if args.quick else args.size)
    repeat = 3 if args.quick else args.repeat
    ctx = multiprocessing.get_context("spawn")
    sock_dir = tempfile.mkdtemp(dir="/tmp", prefix="aib-bf-")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server_main, args=(nbytes, args.batch_rows, args.gpu, sock_dir, child))
    proc.start()
    try:
        if not parent.poll(600):
            print("the server process did not start", file=sys.stderr)
            return 1
        info = parent.recv()
        gib = info["nbytes"] / (1 << 30)
        plain: list[float] = []
        front: list[float] = []
        gpu: list[float] = []
        for _ in range(repeat):  # alternate, so that load on the machine falls on both alike
            plain += time_do_get(info["plain"], b"host", 1)
            front += time_do_get(info["front"], b"host", 1)
            if args.gpu:
                gpu += time_do_get(info["front"], b"gpu", 1)
        same_host = time_same_host_gets(
            {"socket": info["socket"], "grpc": info["front"]}, rounds=max(repeat, 5) * 2, per_round=10
        )
        parent.send("done")
    finally:
        proc.join(120)
        if proc.is_alive():
            proc.kill()
    best_plain, best_front = min(plain), min(front)
    med_plain, med_front = statistics.median(plain), statistics.median(front)
    mib = info["nbytes"] / (1 << 20)
    print(f"table: {mib:.0f} MiB, {COLUMNS} float32 columns, {info['batches']} batches")
    print(f"plain pyarrow.flight do_get: best {gib / best_plain:6.2f} GiB/s, median {gib / med_plain:6.2f}")
    print(f"bridge Flight front do_get:  best {gib / best_front:6.2f} GiB/s, median {gib / med_front:6.2f}")
    print(
        f"  front / plain throughput: best {best_plain / best_front:.2f}x, "
        f"median {med_plain / med_front:.2f}x (target >= 0.9)"
    )
    spreads = {label: spread(facts["s"]) for label, facts in same_host.items()}
    rounds = max(repeat, 5) * 2
    print(f"same-host get + pa.table + release, {rounds} alternating rounds of 10 gets each:")
    for label, title in (("socket", "connect(socket)      "), ("grpc", "connect(grpc address)")):
        facts, figures = same_host[label], spreads[label]
        counters = facts["counters"]
        print(
            f"  {title}: median {figures['median'] * 1e6:8.1f} us, p10 {figures['p10'] * 1e6:8.1f}, "
            f"p90 {figures['p90'] * 1e6:8.1f}, best {figures['best'] * 1e6:8.1f}  "
            f"[route {facts['route']}, {facts['session_type']}; remembered gets "
            f"{counters['remembered_gets']}, python imports {counters['python_imports']}, regions mapped "
            f"{counters['regions_mapped']}; {facts['threads_after_connect']} threads]"
        )
    print(f"  grpc route reason: {same_host['grpc']['route_reason']}")
    socket_figures, grpc_figures = spreads["socket"], spreads["grpc"]
    print(
        f"  grpc / socket: median {grpc_figures['median'] / socket_figures['median']:.2f}x, "
        f"best {grpc_figures['best'] / socket_figures['best']:.2f}x, "
        f"p90 {grpc_figures['p90'] / socket_figures['p90']:.2f}x (target <= 1.2)"
    )
    results: dict[str, Any] = {
        "nbytes": info["nbytes"],
        "plain_s": plain,
        "front_s": front,
        "bridge_get_s": same_host["socket"]["s"],
        "flight_address_get_s": same_host["grpc"]["s"],
        "route": same_host["grpc"]["route"],
        "same_host": same_host,
    }
    if args.gpu:
        best_gpu = min(gpu)
        bound = info["d2h_s"] + best_plain
        med_gpu = statistics.median(gpu)
        print(
            f"copy bandwidth, GPU 0 <-> pinned host, {mib:.0f} MiB: H2D {gib / info['h2d_s']:6.2f} GiB/s, "
            f"D2H {gib / info['d2h_s']:6.2f} GiB/s"
        )
        print(
            f"GPU table do_get: best {gib / best_gpu:6.2f} GiB/s ({best_gpu:.3f} s), median "
            f"{gib / med_gpu:6.2f}; against D2H + plain do_get {bound:.3f} s: best "
            f"{best_gpu / bound:.2f}x, median {med_gpu / (info['d2h_s'] + med_plain):.2f}x (target <= 1.2)"
        )
        results.update(gpu_s=gpu, d2h_s=info["d2h_s"], h2d_s=info["h2d_s"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
