"""``bench``'s timed operations: one consumer step each, for the bridge and for its peer.

Each returns ``(seconds, value)``: the time from the request to one value read from what arrived (so
the data is known to be reachable; columns never touched would prove nothing), and that value, which
the caller checks. Releasing what arrived comes after the clock stops.

Only the standard library is imported at the top, and the package only inside a step: the
benchmarks in the source tree load this file by its path to time other checkouts of the bridge
(whichever ``arrow_ipc_bridge`` is importable there) with the very same steps
(``benchmarks/bench_reget.py --tree``), so each step is written once.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["bridge_reget_cuda", "bridge_reget_host", "ipc_file_read", "last_value", "torch_queue_get"]


def last_value(table: Any) -> float:
    """The last value of the last column of a pyarrow table or record batch."""
    column = table.column(table.num_columns - 1)
    value: float = column[len(column) - 1].as_py()
    return value


def bridge_reget_host(session: Any, name: str) -> tuple[float, float]:
    """``session.get(name)``, ``pa.table`` of it, a value read; then the import released."""
    import pyarrow as pa

    started = time.perf_counter()
    imported = session.get(name)
    value = last_value(pa.table(imported))
    elapsed = time.perf_counter() - started
    imported.release()
    return elapsed, value


def ipc_file_read(path: str) -> tuple[float, float]:
    """An Arrow IPC file opened with ``memory_map`` and read with ``read_all`` (no copy of the
    buffers), a value read."""
    import pyarrow as pa

    started = time.perf_counter()
    value = last_value(pa.ipc.open_file(pa.memory_map(path)).read_all())
    return time.perf_counter() - started, value


def bridge_reget_cuda(session: Any, name: str) -> tuple[float, float]:
    """``session.get(name)`` of CUDA columns, every column as a torch tensor
    (``aib.column_arrays``, whose stream waits on the producer's event), a value copied to the host
    (which waits for the device); then the import released."""
    import arrow_ipc_bridge as aib

    started = time.perf_counter()
    imported = session.get(name)
    tensors = list(aib.column_arrays(imported, "torch").values())
    value = float(tensors[-1][-1].item())
    elapsed = time.perf_counter() - started
    del tensors
    imported.release()
    return elapsed, value


def torch_queue_get(ask: Any, queue: Any, step: int) -> tuple[float, float]:
    """``ask(step)`` (the producer then puts its tensors on ``queue``), ``queue.get()``, a value
    copied to the host. The queue's item is ``(step, tensors)``: a step that does not match is a
    ``RuntimeError`` (an answer to another request)."""
    started = time.perf_counter()
    ask(step)
    sent, tensors = queue.get()
    value = float(tensors[-1][-1].item())
    elapsed = time.perf_counter() - started
    if sent != step:
        raise RuntimeError(f"step {step}: the torch queue held step {sent}")
    return elapsed, value
