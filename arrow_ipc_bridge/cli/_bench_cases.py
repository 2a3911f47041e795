"""``bench``'s cases: what the producer and the consumer process each do to move the same columns
from one to the other, for the bridge and for each peer, in host memory or on a CUDA GPU.

Every case is a pair of sides. The consumer's side takes one sample at a time: ``fetch(step)`` is the
timed part (ask if the case needs the producer, receive, read one value); ``release()`` drops what it
got, outside the timing. Before each sample the producer's side ``prepare(step)``s, outside the
timing too: it writes the step's value into its columns (fresh data) and, for a first get, publishes
a new copy. ``hand_off(step)`` is the producer's share of the timed part, run when the consumer asks.
The consumer checks the value it read against the step, so a case that moved stale data fails.
"""

from __future__ import annotations

import importlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "BRIDGE_CASES",
    "CASE_LABELS",
    "PEER_CASES",
    "REFERENCE_CASE",
    "ConsumerCase",
    "ConsumerLinks",
    "ProducerCase",
    "ProducerLinks",
    "Shape",
    "consumer_case",
    "producer_case",
]

CASE_LABELS: Final = {
    "bridge_reget": "bridge re-get",
    "bridge_first": "bridge first get",
    "bridge_fresh": "bridge fresh data",
    "torch": "torch.multiprocessing Queue",
    "ipc": "Arrow IPC bytes, socket",
    "pickle": "pickle, mp Pipe",
}
BRIDGE_CASES: Final = ("bridge_reget", "bridge_first", "bridge_fresh")
PEER_CASES: Final = ("torch", "ipc", "pickle")
# Every ratio is against the bridge's hand-off of fresh data: like the peers, it moves data the
# producer has just written, producer and notification included.
REFERENCE_CASE: Final = "bridge_fresh"

# What the re-get case publishes once: no step writes it, so a stale read shows.
_REGET_VALUE: Final = -1.0
_LENGTH: Final = struct.Struct("<Q")


@dataclass(frozen=True)
class Shape:
    """The columns a case moves: ``columns`` float64 columns of ``rows`` values, on ``device``
    (``"host"``, or ``"cuda"``: GPU 0)."""

    device: str
    columns: int
    rows: int

    @property
    def names(self) -> list[str]:
        return [f"c{i:02d}" for i in range(self.columns)]


@dataclass
class ProducerLinks:
    """What the producer process holds for every case: the publisher, the control connection to the
    consumer, and each peer's channel."""

    publisher: Any
    control: Any  # multiprocessing Connection
    pickle_pipe: Any  # multiprocessing Connection
    ipc_socket: socket.socket
    torch_queue: Any  # multiprocessing Queue


@dataclass
class ConsumerLinks:
    """The consumer's ends: its session and the same channels."""

    session: Any
    control: Any
    pickle_pipe: Any
    ipc_socket: socket.socket
    torch_queue: Any


class ProducerCase:
    """The producer's side of a case (see the module's docstring)."""

    def prepare(self, step: int) -> None:
        """Untimed, before sample ``step``: write the step's value where the case needs it."""

    def hand_off(self, step: int) -> None:
        """Timed, on the consumer's request: send the data (cases that need no request never run it)."""
        raise RuntimeError(f"{type(self).__name__} takes no request from the consumer")

    def close(self) -> None:
        """The case is over and the consumer holds nothing of it."""


class ConsumerCase:
    """The consumer's side of a case (see the module's docstring)."""

    def fetch(self, step: int) -> float:
        """Timed: ask if needed, receive, read one value (the last of the last column); return it."""
        raise NotImplementedError

    def expected(self, step: int) -> float:
        """The value ``fetch(step)`` must have read."""
        return float(step)

    def release(self) -> None:
        """Untimed: drop what the last fetch received."""

    def close(self) -> None:
        """The case is over."""


# ---------- columns ---------------------------------------------------------------------------------
def _numpy() -> Any:
    return importlib.import_module("numpy")


def _pyarrow() -> Any:
    return importlib.import_module("pyarrow")


def _cupy() -> Any:
    return importlib.import_module("cupy")


def _torch() -> Any:
    return importlib.import_module("torch")


class _HeapColumns:
    """NumPy arrays in ordinary heap memory, and a record batch over them (no copy: writes to the
    arrays show in the batch)."""

    def __init__(self, shape: Shape, value: float) -> None:
        np, pa = _numpy(), _pyarrow()
        self.arrays = [np.full(shape.rows, value, dtype=np.float64) for _ in range(shape.columns)]
        self.batch = pa.record_batch([pa.array(array) for array in self.arrays], names=shape.names)

    def fill(self, value: float) -> None:
        for array in self.arrays:
            array.fill(value)


class _SharedColumns:
    """The columns in one ``allocate_shared`` allocation: a record batch over it exports with no
    copy, and the producer writes the next step's values in place."""

    def __init__(self, shape: Shape) -> None:
        import arrow_ipc_bridge as aib

        np, pa = _numpy(), _pyarrow()
        column_bytes = shape.rows * 8
        self._memory = aib.allocate_shared(column_bytes * shape.columns, name="aib-bench")
        self._matrix = np.frombuffer(self._memory.view(), dtype=np.float64).reshape(shape.columns, shape.rows)
        whole = self._memory.as_pyarrow()
        self.batch = pa.record_batch(
            [
                pa.Array.from_buffers(
                    pa.float64(), shape.rows, [None, whole.slice(i * column_bytes, column_bytes)]
                )
                for i in range(shape.columns)
            ],
            names=shape.names,
        )

    def fill(self, value: float) -> None:
        self._matrix.fill(value)

    def close(self) -> None:
        self.batch = None
        self._matrix = None
        self._memory.close()


class _CudaColumns:
    """CuPy arrays on GPU 0. ``fill`` waits for its kernels: the producer's own work is not part of
    a hand-off, for the bridge and for the peers alike."""

    def __init__(self, shape: Shape, value: float) -> None:
        cupy = _cupy()
        self._cupy = cupy
        with cupy.cuda.Device(0):
            self.arrays = {name: cupy.empty(shape.rows, dtype=cupy.float64) for name in shape.names}
        self.fill(value)

    def fill(self, value: float) -> None:
        with self._cupy.cuda.Device(0) as device:
            for array in self.arrays.values():
                array.fill(value)
            device.synchronize()


def _last_value_host(batch: Any) -> float:
    value: float = batch.column(batch.num_columns - 1)[-1].as_py()
    return value


def _last_value_cuda(arrays: Any) -> float:
    """A 8-byte copy to the host, after whatever the arrays' stream waits on."""
    return float(arrays[-1][-1].item())


# ---------- the bridge ------------------------------------------------------------------------------
class _BridgeRegetProducer(ProducerCase):
    """Published once; the consumer gets it again and again (its session remembers the message)."""

    def __init__(self, links: ProducerLinks, shape: Shape) -> None:
        self._publisher = links.publisher
        if shape.device == "host":
            self._columns: Any = _HeapColumns(shape, _REGET_VALUE)
            self._publisher.publish("reget", self._columns.batch)  # copied once into a sealed memfd
        else:
            import arrow_ipc_bridge as aib

            self._columns = _CudaColumns(shape, _REGET_VALUE)
            self._publisher.publish("reget", aib.from_cuda_arrays(self._columns.arrays))

    def close(self) -> None:
        self._publisher.unpublish("reget")


class _BridgeFirstProducer(ProducerCase):
    """Before each sample, a new copy of the columns under the same name: the consumer's get is its
    first sight of that message and of its memory (a new sealed memfd to map; on a GPU, a new
    ``aib.to_device`` upload into the bridge's IPC pool, whose pointer it imports)."""

    def __init__(self, links: ProducerLinks, shape: Shape) -> None:
        self._publisher = links.publisher
        self._device = shape.device
        self._columns = _HeapColumns(shape, 0.0)
        self._uploaded: Any = None

    def prepare(self, step: int) -> None:
        self._columns.fill(float(step))
        if self._device == "host":
            self._publisher.publish("first", self._columns.batch, copy="always")
            return
        import arrow_ipc_bridge as aib

        previous = self._uploaded
        self._uploaded = aib.to_device(self._columns.batch, 0)
        self._publisher.publish("first", self._uploaded)
        if previous is not None:
            previous.release()  # its memory goes back to the pool once the consumer's lease ends

    def close(self) -> None:
        self._publisher.unpublish("first")
        if self._uploaded is not None:
            self._uploaded.release()


class _BridgeFreshProducer(ProducerCase):
    """The producer writes the step's values into its columns in place (untimed) and, on the
    consumer's request, publishes them and says so: the hand-off of fresh data. Host columns live in
    ``allocate_shared`` memory (published with no copy), CUDA columns are CuPy arrays."""

    def __init__(self, links: ProducerLinks, shape: Shape) -> None:
        self._links = links
        self._device = shape.device
        self._columns: Any = _SharedColumns(shape) if shape.device == "host" else _CudaColumns(shape, 0.0)

    def prepare(self, step: int) -> None:
        self._columns.fill(float(step))

    def hand_off(self, step: int) -> None:
        if self._device == "host":
            self._links.publisher.publish("fresh", self._columns.batch, copy="never")
        else:
            import arrow_ipc_bridge as aib

            self._links.publisher.publish("fresh", aib.from_cuda_arrays(self._columns.arrays))
        self._links.control.send(("published", step))

    def close(self) -> None:
        self._links.publisher.unpublish("fresh")
        if self._device == "host":
            self._columns.close()


class _BridgeConsumer(ConsumerCase):
    """``session.get(name)``, then the columns as a consumer uses them: a pyarrow record batch (host)
    or CuPy arrays (``aib.column_arrays``, whose stream waits on the producer's event), and one value
    read. ``ask``: the producer publishes on request (fresh data)."""

    def __init__(
        self, links: ConsumerLinks, shape: Shape, name: str, *, ask: bool, value: float | None
    ) -> None:
        self._links = links
        self._device = shape.device
        self._name = name
        self._ask = ask
        self._value = value
        self._imported: Any = None
        self._held: Any = None

    def fetch(self, step: int) -> float:
        if self._ask:
            self._links.control.send(("go", step))
            answer = self._links.control.recv()
            if answer != ("published", step):
                raise RuntimeError(f"step {step}: the producer answered {answer!r}")
        self._imported = self._links.session.get(self._name)
        if self._device == "host":
            self._held = _pyarrow().record_batch(self._imported)
            return _last_value_host(self._held)
        import arrow_ipc_bridge as aib

        self._held = list(aib.column_arrays(self._imported, "cupy").values())
        return _last_value_cuda(self._held)

    def expected(self, step: int) -> float:
        return float(step) if self._value is None else self._value

    def release(self) -> None:
        self._held = None
        if self._imported is not None:
            self._imported.release()
            self._imported = None


# ---------- the peers -------------------------------------------------------------------------------
class _PeerProducer(ProducerCase):
    """The columns in the peer's natural form: NumPy arrays behind a record batch on the host, CuPy
    arrays on the GPU; written with the step's values before each sample."""

    def __init__(self, links: ProducerLinks, shape: Shape) -> None:
        self._links = links
        self._shape = shape
        self._columns: Any = _HeapColumns(shape, 0.0) if shape.device == "host" else _CudaColumns(shape, 0.0)

    def prepare(self, step: int) -> None:
        self._columns.fill(float(step))


class _PickleProducer(_PeerProducer):
    """``Connection.send``: pickled, every buffer copied into the pickle and out of it again; CuPy
    arrays pickle through a copy to the host and unpickle through one back to the GPU."""

    def hand_off(self, step: int) -> None:
        if self._shape.device == "host":
            self._links.pickle_pipe.send(self._columns.batch)
        else:
            self._links.pickle_pipe.send(list(self._columns.arrays.values()))


class _IpcProducer(_PeerProducer):
    """The columns written as an Arrow IPC stream (a copy to the host first on a GPU), sent as
    length-prefixed bytes."""

    def hand_off(self, step: int) -> None:
        pa = _pyarrow()
        if self._shape.device == "host":
            batch = self._columns.batch
        else:
            cupy = _cupy()
            arrays = [pa.array(cupy.asnumpy(array)) for array in self._columns.arrays.values()]
            batch = pa.record_batch(arrays, names=self._shape.names)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        payload = sink.getvalue()
        self._links.ipc_socket.sendall(_LENGTH.pack(payload.size))
        self._links.ipc_socket.sendall(payload)


class _TorchProducer(ProducerCase):
    """torch tensors put on a ``torch.multiprocessing`` Queue: host tensors in shared memory (moved
    there once, before the first sample), CUDA tensors shared by CUDA IPC; written in place."""

    def __init__(self, links: ProducerLinks, shape: Shape) -> None:
        torch = _torch()
        importlib.import_module("torch.multiprocessing")  # its reductions share storages, not bytes
        self._torch = torch
        self._links = links
        self._cuda = shape.device == "cuda"
        where = "cuda:0" if self._cuda else "cpu"
        self._tensors = [
            torch.zeros(shape.rows, dtype=torch.float64, device=where) for _ in range(shape.columns)
        ]
        if not self._cuda:
            for tensor in self._tensors:
                tensor.share_memory_()

    def prepare(self, step: int) -> None:
        for tensor in self._tensors:
            tensor.fill_(float(step))
        if self._cuda:
            self._torch.cuda.synchronize(0)

    def hand_off(self, step: int) -> None:
        self._links.torch_queue.put((step, self._tensors))


class _PeerConsumer(ConsumerCase):
    """Asks the producer over the control connection, then receives on the peer's channel."""

    def __init__(self, links: ConsumerLinks, shape: Shape) -> None:
        self._links = links
        self._shape = shape
        self._held: Any = None

    def _ask(self, step: int) -> None:
        self._links.control.send(("go", step))

    def release(self) -> None:
        self._held = None


class _PickleConsumer(_PeerConsumer):
    def fetch(self, step: int) -> float:
        self._ask(step)
        self._held = self._links.pickle_pipe.recv()
        if self._shape.device == "host":
            return _last_value_host(self._held)
        return _last_value_cuda(self._held)


class _IpcConsumer(_PeerConsumer):
    """Reads the bytes into one buffer, then the batch over it (no further copy); on a GPU, each
    column copied to the device."""

    def fetch(self, step: int) -> float:
        pa = _pyarrow()
        self._ask(step)
        (size,) = _LENGTH.unpack(_receive_exactly(self._links.ipc_socket, _LENGTH.size))
        batch = pa.ipc.open_stream(
            pa.py_buffer(_receive_exactly(self._links.ipc_socket, size))
        ).read_next_batch()
        if self._shape.device == "host":
            self._held = batch
            return _last_value_host(batch)
        cupy = _cupy()
        with cupy.cuda.Device(0):
            self._held = [cupy.asarray(column.to_numpy()) for column in batch.columns]
        return _last_value_cuda(self._held)


class _TorchConsumer(_PeerConsumer):
    def __init__(self, links: ConsumerLinks, shape: Shape) -> None:
        super().__init__(links, shape)
        importlib.import_module("torch.multiprocessing")  # outside the timing: importing torch is slow

    def fetch(self, step: int) -> float:
        self._ask(step)
        sent, tensors = self._links.torch_queue.get()
        if sent != step:
            raise RuntimeError(f"step {step}: the queue held step {sent}")
        self._held = tensors
        return float(tensors[-1][-1].item())


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    received = 0
    while received < size:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise ConnectionError(f"the producer closed the socket after {received} of {size} bytes")
        received += n
    return data


# ---------- the cases by name ------------------------------------------------------------------------
def producer_case(case: str, links: ProducerLinks, shape: Shape) -> ProducerCase:
    """The producer's side of ``case`` (a key of ``CASE_LABELS``), its columns made."""
    sides: dict[str, Callable[[ProducerLinks, Shape], ProducerCase]] = {
        "bridge_reget": _BridgeRegetProducer,
        "bridge_first": _BridgeFirstProducer,
        "bridge_fresh": _BridgeFreshProducer,
        "pickle": _PickleProducer,
        "ipc": _IpcProducer,
        "torch": _TorchProducer,
    }
    return sides[case](links, shape)


def consumer_case(case: str, links: ConsumerLinks, shape: Shape) -> ConsumerCase:
    """The consumer's side of ``case``."""
    if case == "bridge_reget":
        return _BridgeConsumer(links, shape, "reget", ask=False, value=_REGET_VALUE)
    if case == "bridge_first":
        return _BridgeConsumer(links, shape, "first", ask=False, value=None)
    if case == "bridge_fresh":
        return _BridgeConsumer(links, shape, "fresh", ask=True, value=None)
    peers: dict[str, type[_PeerConsumer]] = {
        "pickle": _PickleConsumer,
        "ipc": _IpcConsumer,
        "torch": _TorchConsumer,
    }
    return peers[case](links, shape)
