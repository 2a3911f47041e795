"""Scenarios run in a child process over the stand-in driver (``fake_libcuda.c``) for
tests/test_in_place_cpu.py: the producer's in-place path and the table of column facts that live
publications hold, exercised without a GPU. Each prints one JSON line of what it saw.

    ARROW_IPC_BRIDGE_LIBCUDA=.../libfakecuda.so python -m helpers.fake_cuda_children SCENARIO
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time
from typing import Any

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.arrays import device
from arrow_ipc_bridge.runtime import reaper

MIB = 1 << 20
DEVICE_BASE = 0x700000000000  # fake_libcuda.c's fake_device_base: device memory from here up
_fake = ctypes.CDLL(os.environ["ARROW_IPC_BRIDGE_LIBCUDA"])  # the library the bridge opens too


def _counter(name: str) -> int:
    return int(ctypes.c_int.in_dll(_fake, name).value)


class FakeArray:
    """A 1-D float32 array at ``pointer`` as ``__cuda_array_interface__`` shows it (never read)."""

    def __init__(self, pointer: int, length: int = 1024, stream: int | None = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "<f4",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
            "stream": stream,
        }


def _columns(first_mib: int, n: int = 4, stream: int | None = None) -> dict[str, FakeArray]:
    return {f"c{i}": FakeArray(DEVICE_BASE + (first_mib + i) * MIB, stream=stream) for i in range(n)}


def _in_place() -> int:
    return aib.stats().cuda.in_place_publishes


class _Delta:
    """Counters' growth over a block."""

    def __init__(self) -> None:
        self.start = self._now()

    @staticmethod
    def _now() -> dict[str, int]:
        counters = {k: _counter(f"fake_{k}") for k in ("pointer_queries", "waits", "records", "pushes")}
        counters["in_place"] = _in_place()
        return counters

    def __call__(self) -> dict[str, int]:
        now = self._now()
        return {k: now[k] - self.start[k] for k in now}


def _bridge_error(call: Any) -> str | None:
    """The name of the BridgeError ``call()`` raises; None when it returns."""
    try:
        call()
    except aib.BridgeError as exc:
        return type(exc).__name__
    return None


def _publisher() -> aib.Publisher:
    return aib.Publisher(os.path.join(tempfile.mkdtemp(dir="/tmp"), "fake.sock"))


def renewal() -> dict[str, Any]:
    """The same columns again renew the current version; other columns, other names, a replaced or
    unpublished publication take the full path; the facts table follows the live exports."""
    seen: dict[str, Any] = {}
    cols = _columns(0)
    with _publisher() as pub:
        pub.publish("t", aib.from_cuda_arrays(cols))
        first, version = pub._current["t"], pub.version("t")
        seen["held_first"] = device.held_column_facts()
        delta = _Delta()
        batch = aib.from_cuda_arrays(cols)
        seen["wrap_same"] = delta()
        delta = _Delta()
        pub.publish("t", batch)
        seen["publish_same"] = delta()
        seen["same_export"] = pub._current["t"] is first
        seen["version_step"] = pub.version("t") - version
        delta = _Delta()
        pub.publish("t", aib.from_cuda_arrays({f"x{i}": a for i, a in enumerate(cols.values())}))
        seen["other_names"] = delta()
        renamed = pub._current["t"]
        seen["renamed_is_new"] = renamed is not first
        reaper.settle()
        seen["first_closed"] = first.closed  # replaced, no lease: closed, its facts out of the table
        other = _columns(16)
        delta = _Delta()
        pub.publish("t", aib.from_cuda_arrays(other))
        seen["other_columns"] = delta()
        reaper.settle()
        seen["renamed_closed"] = renamed.closed
        seen["held_other"] = device.held_column_facts()
        delta = _Delta()
        replaced = aib.from_cuda_arrays(cols)  # no live publication holds these any more
        seen["wrap_replaced"] = delta()
        delta = _Delta()
        pub.publish("t", replaced)
        seen["publish_replaced"] = delta()
        pub.unpublish("t")
        reaper.settle()
        seen["held_unpublished"] = device.held_column_facts()
        delta = _Delta()
        pub.publish("t", aib.from_cuda_arrays(cols))
        seen["publish_unpublished"] = delta()
        seen["held_republished"] = device.held_column_facts()
        # A second name holding the same columns: the facts stay while either export is open.
        pub.publish("u", aib.from_cuda_arrays(cols))
        pub.unpublish("t")
        reaper.settle()
        seen["held_second_name"] = device.held_column_facts()
        delta = _Delta()
        aib.from_cuda_arrays(cols)
        seen["wrap_second_name"] = delta()
    reaper.settle()
    seen["held_closed"] = device.held_column_facts()
    return seen


def streams() -> dict[str, Any]:
    """The in-place record waits for the producer's event only when the columns announced a real
    stream (not the legacy default stream, nor none)."""
    seen: dict[str, Any] = {}
    with _publisher() as pub:
        for label, stream in (("none", None), ("legacy", 1), ("real", 0x5000)):
            cols = _columns(32 + 8 * len(seen), stream=stream)
            pub.publish(label, aib.from_cuda_arrays(cols))
            delta = _Delta()
            pub.publish(label, aib.from_cuda_arrays(cols))
            seen[label] = delta()
    return seen


def reused_address() -> dict[str, Any]:
    """After the publication that held the columns closed, their addresses are queried again: memory
    freed and handed out again (here: answering as pinned host memory) is refused at the call."""
    seen: dict[str, Any] = {}
    cols = _columns(64)
    with _publisher() as pub:
        pub.publish("t", aib.from_cuda_arrays(cols))
        pub.unpublish("t")
        reaper.settle()
        ctypes.c_uint64.in_dll(_fake, "fake_device_base").value = DEVICE_BASE + 128 * MIB
        try:
            aib.from_cuda_arrays(cols)
            seen["error"] = None
        except aib.BridgeError as exc:
            seen["error"] = type(exc).__name__
        finally:
            ctypes.c_uint64.in_dll(_fake, "fake_device_base").value = DEVICE_BASE
    return seen


def closed() -> dict[str, Any]:
    """A publish after close raises ClosedError and records nothing; the facts table is empty."""
    seen: dict[str, Any] = {}
    cols = _columns(96)
    pub = _publisher()
    pub.publish("t", aib.from_cuda_arrays(cols))
    batch = aib.from_cuda_arrays(cols)
    pub.close()
    reaper.settle()
    delta = _Delta()
    seen["error"] = _bridge_error(lambda: pub.publish("t", batch))
    seen["publish_closed"] = delta()
    seen["held"] = device.held_column_facts()
    return seen


def context() -> dict[str, Any]:
    """On a thread with no current context, the shared event's record pushes the device's primary
    context and pops it after; on one where it is current, nothing is pushed."""
    seen: dict[str, Any] = {}
    cols = _columns(112)
    with _publisher() as pub:
        pub.publish("t", aib.from_cuda_arrays(cols))
        delta = _Delta()
        pub.publish("t", aib.from_cuda_arrays(cols))
        seen["current"] = delta()
        _fake.fake_clear_context()
        delta = _Delta()
        pub.publish("t", aib.from_cuda_arrays(cols))
        seen["none_current"] = delta()
        current = ctypes.c_void_p()
        _fake.cuCtxGetCurrent(ctypes.byref(current))
        seen["current_after"] = current.value
    return seen


def forked() -> dict[str, Any]:
    """A child forked while a publication holds the columns does not take their device from the
    parent's table: it asks, and CUDA refuses a forked child (CudaError), as for any columns."""
    cols = _columns(128)
    with _publisher() as pub:
        pub.publish("t", aib.from_cuda_arrays(cols))
        answer = _in_forked_child(lambda: aib.from_cuda_arrays(cols))
        return {"child": answer, "held_parent": device.held_column_facts()}


def _in_forked_child(call: Any) -> str:
    """What ``call()`` does in a child of fork: "no error", the name of the BridgeError it raised,
    or the repr of anything else (the child writes it down a pipe and exits)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one call, its answer down the pipe, and out
        try:
            answer = _bridge_error(call) or "no error"
        except BaseException as exc:  # reported to the parent
            answer = repr(exc)
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        return pipe.read().decode()


def renewals() -> dict[str, Any]:
    """Renewals in place, one after another: one record each, no wait, no query, a version step of
    one each, the same stats returned, the process counter. A copy policy given still renews; other
    columns, a forked child and a closed publisher renew nothing."""
    seen: dict[str, Any] = {}
    cols = _columns(140)
    pub = _publisher()
    pub.publish("t", aib.from_cuda_arrays(cols))
    first = pub.publish("t", aib.from_cuda_arrays(cols))
    version = pub.version("t")
    delta = _Delta()
    returned = [pub.publish("t", aib.from_cuda_arrays(cols)) for _ in range(5)]
    seen["five"] = delta()
    seen["version_steps"] = pub.version("t") - version
    seen["same_stats"] = all(stats is first for stats in returned)
    delta = _Delta()
    pub.publish("t", aib.from_cuda_arrays(cols), copy="if_needed")  # a policy given: renewed too
    seen["policy_given"] = delta()
    batch = aib.from_cuda_arrays(cols)
    seen["forked_child"] = _in_forked_child(lambda: pub.publish("t", batch))  # columns made before
    delta = _Delta()
    pub.publish("t", aib.from_cuda_arrays(_columns(150)))  # other columns: a new publication
    pub.publish("t", batch)  # the first columns again: not the current version's
    seen["other_columns"] = delta()
    pub.close()
    reaper.settle()
    delta = _Delta()
    seen["closed"] = _bridge_error(lambda: pub.publish("t", batch))
    seen["publish_closed"] = delta()
    return seen


def renewal_answers_a_single_wait() -> dict[str, Any]:
    """A renewal in place answers the one WAIT held on its name at once: a raw client's WAIT for a
    version newer than the current one, then a renewal."""
    from arrow_ipc_bridge import transport
    from arrow_ipc_bridge.transport import protocol
    from helpers.session_rig import raw_hello

    seen: dict[str, Any] = {}
    cols = _columns(160)
    pub = _publisher()
    pub.publish("t", aib.from_cuda_arrays(cols))
    pub.publish("t", aib.from_cuda_arrays(cols))  # the first renewal in place
    version = pub.version("t")
    raw = transport.connect(pub.path, timeout=10.0)
    raw_hello(raw)
    raw.send(protocol.WAIT, protocol.encode_wait(version, 60_000, b"t"))
    deadline = time.monotonic() + 10.0
    while pub.held_waits != 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    seen["held"] = pub.held_waits
    delta = _Delta()
    pub.publish("t", aib.from_cuda_arrays(cols))
    seen["renewed"] = delta()["in_place"]
    seen["version"] = pub.version("t")
    try:
        with raw.recv(timeout=10.0) as frame:
            seen["answer"] = frame.kind == protocol.VERSIONED_ITEM
            seen["answered_version"] = protocol.decode_versioned_item(frame.payload)[1]
    except aib.BridgeError as exc:
        seen["answer"] = type(exc).__name__
    raw.close()
    pub.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]]()))
