"""Weight sync: a trainer publishes its model's parameters every step, an inference process
follows, using every parameter in place (no copy) and never reading a half-written version.

The pattern (docs/weight-sync.md explains the guarantee and its costs):

- **One publication per version, one byte column.** An Arrow record batch needs columns of one
  length, and a model's tensors have hundreds of shapes and several dtypes (bfloat16 included,
  which Arrow has no type for). So every parameter gets a place in one flat byte buffer (each at a
  256-byte aligned offset), and a version is that buffer published as a one-column batch. Where
  each parameter lies, with its dtype and shape, is the *layout*: a small host table published
  once under ``<name>.layout``; its digest is in the weight column's name, so a consumer cannot
  read a buffer with another model's layout. The consumer takes the column with
  ``aib.column_arrays`` (a NumPy array or a PyTorch tensor over the producer's memory) and makes
  each parameter a view of it: a slice, a dtype view and a reshape, never a copy.
- **Several publication buffers (slots), reused only when nobody holds them.** The trainer copies
  its parameters into a slot that no consumer holds and publishes that slot as the next version;
  the other slots keep the versions consumers may still be reading. A slot is free again when the
  bridge lets go of what its publication captured: that happens once the publication was replaced
  *and* every consumer's lease on it ended (docs/lifetime.md, 3 and 6). The trainer watches
  exactly that: the buffer it hands to the bridge carries a sentinel object whose finalizer marks
  the slot free, and the bridge drops it only then. So a slot is never written while any consumer
  can read it.
- **The consumer swaps, then releases.** It waits for the newest version
  (``session.get_next``), builds the views, replaces its model's parameter mapping in one
  assignment and only then releases the version it used before (on the GPU after the work it
  queued on the old parameters has finished). Every parameter it reads belongs to one version.

Host memory (``--device cpu``) uses NumPy and ``aib.allocate_shared`` buffers; CUDA
(``--device cuda``) uses PyTorch tensors and needs a GPU and PyTorch with CUDA. The helpers below
(``model_spec``, ``Layout``, ``WeightPublisher``, ``WeightFollower``, ``InferenceModel``) serve both;
``benchmarks/bench_weight_sync.py`` and ``tests/test_weight_sync.py`` use them too.

Run: ``python examples/weight_sync.py`` (host, a small model) or
``python examples/weight_sync.py --device cuda --total-mib 1024 --tensors 300 --steps 50``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

import arrow_ipc_bridge as aib

ALIGNMENT = 256
"""Every parameter starts at a multiple of this many bytes in the flat buffer, so a dtype view of
its slice is aligned for every dtype (and for vectorised GPU kernels)."""

DTYPES: dict[str, tuple[int, str]] = {
    # name: (bytes per element, NumPy dtype that holds it; bfloat16 travels as its 16 bits)
    "bfloat16": (2, "uint16"),
    "float16": (2, "float16"),
    "float32": (4, "float32"),
    "float64": (8, "float64"),
    "int8": (1, "int8"),
    "uint8": (1, "uint8"),
    "int16": (2, "int16"),
    "int32": (4, "int32"),
    "int64": (8, "int64"),
}
"""The parameter dtypes the layout knows. NumPy has no bfloat16: on the host a bfloat16 parameter is
a uint16 array of its bit patterns (PyTorch sees it as ``torch.bfloat16``)."""

MARKERS = 200
"""Step markers cycle through 1..MARKERS: every one is an integer that bfloat16 and float16 hold
exactly, and two versions fewer than MARKERS steps apart never carry the same marker."""


class LayoutError(ValueError):
    """A layout that cannot describe the parameters (unknown dtype, empty, a name twice), or weights
    published under a layout other than the one the consumer read."""


class SlotsBusyError(TimeoutError):
    """No publication slot became free in time: consumers still hold every older version."""


# ---------- the layout ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One parameter's place in the flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


class Layout:
    """Where every parameter lies in one flat byte buffer: name, dtype, shape, offset, size.

    Parameters of one dtype are placed next to each other (in the order given), which keeps the
    buffer's padding to the alignment between parameters and lets a consumer make each dtype's
    views from one dtype view of the buffer."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        if not specs:
            raise LayoutError("a layout needs at least one parameter")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise LayoutError("parameter names must be unique")
        for spec in specs:
            if spec.dtype not in DTYPES:
                raise LayoutError(
                    f"parameter {spec.name!r} has dtype {spec.dtype!r}; known: {sorted(DTYPES)}"
                )
            if spec.offset % ALIGNMENT:
                raise LayoutError(f"parameter {spec.name!r} is not {ALIGNMENT}-byte aligned")
            if spec.nbytes != spec.numel * DTYPES[spec.dtype][0] or any(d < 0 for d in spec.shape):
                raise LayoutError(
                    f"parameter {spec.name!r}: {spec.nbytes} bytes do not fit its shape and dtype"
                )
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.total_bytes = max(_align(spec.offset + max(spec.nbytes, 1)) for spec in specs)
        manifest = json.dumps([[s.name, s.dtype, list(s.shape), s.offset] for s in specs]).encode()
        self.layout_id = hashlib.sha256(manifest).hexdigest()[:16]

    @classmethod
    def plan(cls, parameters: Iterable[tuple[str, str, Sequence[int]]]) -> Layout:
        """A layout for ``(name, dtype, shape)`` triples, grouped by dtype, each aligned."""
        items = [(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in parameters]
        for name, dtype, _ in items:
            if dtype not in DTYPES:
                raise LayoutError(f"parameter {name!r} has dtype {dtype!r}; known: {sorted(DTYPES)}")
        order = {dtype: k for k, dtype in enumerate(dict.fromkeys(dtype for _, dtype, _ in items))}
        specs = []
        offset = 0
        for name, dtype, shape in sorted(items, key=lambda item: order[item[1]]):
            nbytes = math.prod(shape) * DTYPES[dtype][0]
            specs.append(TensorSpec(name, dtype, shape, offset, nbytes))
            offset = _align(offset + nbytes)
        return cls(specs)

    @classmethod
    def of(cls, parameters: Mapping[str, Any]) -> Layout:
        """The layout of a mapping of NumPy arrays or PyTorch tensors (see :func:`dtype_name`)."""
        return cls.plan((name, dtype_name(value), tuple(value.shape)) for name, value in parameters.items())

    @property
    def column(self) -> str:
        """The weight column's name: it carries the layout's digest."""
        return f"weights:{self.layout_id}"

    def to_batch(self) -> pa.RecordBatch:
        """The layout as a small host table (what ``<name>.layout`` publishes)."""
        return pa.record_batch(
            {
                "name": pa.array([s.name for s in self.specs], pa.string()),
                "dtype": pa.array([s.dtype for s in self.specs], pa.string()),
                "shape": pa.array([list(s.shape) for s in self.specs], pa.list_(pa.int64())),
                "offset": pa.array([s.offset for s in self.specs], pa.int64()),
                "nbytes": pa.array([s.nbytes for s in self.specs], pa.int64()),
            },
            metadata={"layout_id": self.layout_id, "alignment": str(ALIGNMENT)},
        )

    @classmethod
    def from_batch(cls, obj: Any) -> Layout:
        """The layout a ``to_batch`` table describes (any Arrow producer of it); checks its digest."""
        batch = pa.record_batch(obj)
        columns = batch.to_pydict()
        specs = [
            TensorSpec(name, dtype, tuple(shape), offset, nbytes)
            for name, dtype, shape, offset, nbytes in zip(
                columns["name"],
                columns["dtype"],
                columns["shape"],
                columns["offset"],
                columns["nbytes"],
                strict=True,
            )
        ]
        layout = cls(specs)
        announced = (batch.schema.metadata or {}).get(b"layout_id", b"").decode()
        if announced != layout.layout_id:
            raise LayoutError(f"the layout table says id {announced!r} but describes {layout.layout_id!r}")
        return layout


def dtype_name(value: Any) -> str:
    """The layout's name of an array's dtype: PyTorch's ``torch.bfloat16`` -> ``"bfloat16"``, NumPy's
    ``float32`` -> ``"float32"``. A NumPy uint16 array stands for bfloat16 only when the caller says
    so (:func:`model_spec` parameters are made that way); on its own it is ``"uint16"``, refused."""
    name = str(value.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise LayoutError(f"dtype {value.dtype} has no place in the layout; known: {sorted(DTYPES)}")
    return name


def model_spec(total_bytes: int, tensors: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A transformer-like list of ``tensors`` parameters of about ``total_bytes`` in all, mixed dtypes.

    Each layer has six: an attention projection (bfloat16, 3h x h), its output (bfloat16, h x h),
    an MLP up projection (float16, 2h x h), its down projection (float32, h x 2h), a norm (float32,
    h) and an int64 buffer (h / 8): 20 h^2 bytes and a little more per layer."""
    if tensors < 1 or total_bytes < 1:
        raise ValueError("a model needs at least one tensor and one byte")
    layers = -(-tensors // 6)
    hidden = max(8, int(math.sqrt(total_bytes / (20 * layers))) // 8 * 8)
    kinds = [
        ("attn.qkv.weight", "bfloat16", (3 * hidden, hidden)),
        ("attn.out.weight", "bfloat16", (hidden, hidden)),
        ("mlp.up.weight", "float16", (2 * hidden, hidden)),
        ("mlp.down.weight", "float32", (hidden, 2 * hidden)),
        ("norm.weight", "float32", (hidden,)),
        ("positions", "int64", (hidden // 8,)),
    ]
    spec = [(f"layers.{i}.{kind}", dtype, shape) for i in range(layers) for kind, dtype, shape in kinds]
    return spec[:tensors]


def marker(step: int) -> int:
    """The value every element of every parameter holds at ``step`` (1..MARKERS)."""
    return step % MARKERS + 1


def _bfloat16_bits(value: int) -> int:
    """The bfloat16 bit pattern of a small integer (exact: its float32 bits' upper half)."""
    return int(np.array(value, dtype=np.float32).view(np.uint32)) >> 16


def host_parameters(spec: Sequence[tuple[str, str, Sequence[int]]]) -> dict[str, np.ndarray]:
    """NumPy parameters for ``spec`` (bfloat16 ones as uint16 bit patterns), zero-filled."""
    return {name: np.zeros(tuple(shape), dtype=DTYPES[dtype][1]) for name, dtype, shape in spec}


def fill_marker(parameters: Mapping[str, Any], dtypes: Mapping[str, str], step: int) -> None:
    """Write ``marker(step)`` into every element of every parameter: the training step of this demo.
    ``dtypes`` names each parameter's dtype (NumPy's uint16 arrays hold bfloat16 bits)."""
    value = marker(step)
    for name, array in parameters.items():
        if isinstance(array, np.ndarray):
            array.fill(_bfloat16_bits(value) if dtypes[name] == "bfloat16" else value)
        else:
            array.fill_(value)  # PyTorch: every dtype holds the small integer exactly


def version_marker(tensors: Mapping[str, Any], layout: Layout) -> int:
    """The one marker every element of every parameter carries; raises ``AssertionError`` naming the
    first parameter that disagrees (a version mixing steps: half-written)."""
    first: int | None = None
    for spec in layout.specs:
        array = tensors[spec.name]
        if array.numel() if hasattr(array, "numel") else array.size:
            low, high = _extremes(array, spec.dtype)
            if low != high:
                raise AssertionError(f"{spec.name} holds values of several steps ({low} to {high})")
            if first is None:
                first = low
            elif low != first:
                raise AssertionError(
                    f"{spec.name} is at marker {low}, the version's first parameter at {first}"
                )
    if first is None:
        raise AssertionError("the version has no parameter with elements")
    return first


def _extremes(array: Any, dtype: str) -> tuple[int, int]:
    if isinstance(array, np.ndarray):
        if dtype == "bfloat16":
            values = (array.astype(np.uint32) << 16).view(np.float32)
            return int(values.min()), int(values.max())
        return int(array.min()), int(array.max())
    low, high = array.min(), array.max()  # PyTorch: two reductions on the array's device
    return int(low.item()), int(high.item())


# ---------- the trainer's side ----------------------------------------------------------------------------


class _SlotHold:
    """What the bridge holds of one published slot: the slot's memory stays alive through it, and its
    finalizer runs when the bridge lets go of the publication (replaced and every lease ended)."""

    def __init__(self, owner: Any, address: int, nbytes: int, stream: int | None = None) -> None:
        self._owner = owner  # the slot's buffer (SharedHostBuffer or torch tensor): its memory lives
        self._address = address
        self._nbytes = nbytes
        self._stream = stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # A 1-D uint8 array over the slot; v3's stream is the one the slot was written on, so the
        # bridge records the consumers' event there (1: the legacy default stream).
        return {
            "shape": (self._nbytes,),
            "typestr": "|u1",
            "data": (self._address, False),
            "strides": None,
            "version": 3,
            "stream": self._stream,
        }


class WeightPublisher:
    """Publishes versions of a model's parameters under ``name`` through ``publisher``.

    ``device``: ``"cpu"`` (NumPy parameters, slots in ``aib.allocate_shared`` memory) or ``"cuda"``
    (PyTorch parameters, slots allocated with ``torch.empty`` on ``cuda_device``). ``slots`` (>= 2)
    buffers take turns; :meth:`publish` waits up to ``timeout`` seconds for one that no consumer
    holds (``SlotsBusyError`` past it). The layout is published once, at construction, under
    ``name + ".layout"``.
    """

    def __init__(
        self,
        publisher: aib.Publisher,
        name: str,
        layout: Layout,
        *,
        device: str = "cpu",
        slots: int = 2,
        cuda_device: int = 0,
    ) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
            # One slot would be overwritten while it is the published version.
            raise ValueError(f"slots must be an int >= 2, not {slots!r}")
        self.publisher = publisher
        self.name = name
        self.layout = layout
        self.device = device
        self._free = [threading.Event() for _ in range(slots)]
        for event in self._free:
            event.set()
        self._current: int | None = None
        self.slot_waits = 0  # publishes that had to wait for a slot
        if device == "cpu":
            self._buffers: list[Any] = [
                aib.allocate_shared(layout.total_bytes, name=f"{name}-slot{k}") for k in range(slots)
            ]
            flats = [np.frombuffer(buffer.view(), dtype=np.uint8) for buffer in self._buffers]
            self._addresses = [buffer.address for buffer in self._buffers]
        else:
            import torch

            self._torch = torch
            self._buffers = [
                torch.empty(layout.total_bytes, dtype=torch.uint8, device=f"cuda:{cuda_device}")
                for _ in range(slots)
            ]
            flats = self._buffers
            self._addresses = [buffer.data_ptr() for buffer in self._buffers]
        self._views = [parameter_views(flat, layout) for flat in flats]
        publisher.publish(name + ".layout", layout.to_batch())

    @property
    def slots(self) -> int:
        return len(self._buffers)

    def free_slots(self) -> int:
        """Slots no publication and no consumer holds now."""
        return sum(event.is_set() for event in self._free)

    def _take_slot(self, timeout: float | None) -> int:
        # The slot after the current one, in turn: with two slots the one not published.
        start = 0 if self._current is None else self._current + 1
        order = [(start + k) % self.slots for k in range(self.slots)]
        for k in order:
            if self._free[k].is_set():
                return k
        self.slot_waits += 1
        k = order[0]  # the oldest version's slot is the first a consumer lets go of
        if not self._free[k].wait(timeout):
            raise SlotsBusyError(
                f"no publication slot of {self.name!r} became free in {timeout} s: consumers still hold "
                f"all {self.slots} versions (a consumer must release a version once it moved to a newer one)"
            )
        return k

    def publish(self, parameters: Mapping[str, Any], *, timeout: float | None = 60.0) -> int:
        """Copy ``parameters`` (the layout's names; NumPy arrays or PyTorch tensors as ``device``
        says) into a free slot and publish it as the next version; returns that version."""
        k = self._take_slot(timeout)
        views = self._views[k]
        if self.device == "cpu":
            for name, view in views.items():
                np.copyto(view, parameters[name], casting="no")
            hold = _SlotHold(self._buffers[k], self._addresses[k], self.layout.total_bytes)
            data = pa.foreign_buffer(self._addresses[k], self.layout.total_bytes, base=hold)
            column = pa.Array.from_buffers(pa.uint8(), self.layout.total_bytes, [None, data])
            obj: Any = pa.RecordBatch.from_arrays([column], names=[self.layout.column])
            del data, column
        else:
            torch = self._torch
            names = list(views)
            copy_all(torch, [views[n] for n in names], [parameters[n] for n in names])
            stream = torch.cuda.current_stream(self._buffers[k].device).cuda_stream or 1
            hold = _SlotHold(self._buffers[k], self._addresses[k], self.layout.total_bytes, stream)
            obj = aib.from_cuda_arrays({self.layout.column: hold})
        self._free[k].clear()
        weakref.finalize(hold, self._free[k].set)
        del hold  # from here only the bridge holds it: its end marks the slot free
        try:
            self.publisher.publish(self.name, obj, copy="never")  # zero-copy or an error, never a copy
        except BaseException:
            del obj  # nothing was published: the slot is free again once the columns are gone
            raise
        del obj
        self._current = k
        return self.publisher.version(self.name)

    def close(self) -> None:
        """Stop publishing the weights (consumers keep what they hold) and drop this side's buffers."""
        for name in (self.name, self.name + ".layout"):
            if name in self.publisher.names():
                self.publisher.unpublish(name)
        self._views = []
        self._buffers = []


def copy_all(torch: Any, destinations: list[Any], sources: list[Any]) -> None:
    """Copy each source tensor into its destination on the current stream: one fused
    ``torch._foreach_copy_`` where this PyTorch has it (2.1 on), else a ``copy_`` per tensor."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(destinations, sources)
        return
    for destination, source in zip(destinations, sources, strict=True):
        destination.copy_(source)


def parameter_views(flat: Any, layout: Layout) -> dict[str, Any]:
    """Every parameter as a view of ``flat`` (a 1-D uint8 NumPy array or PyTorch tensor over the
    whole buffer): a slice, a dtype view and a reshape each, no copy. NumPy bfloat16 parameters are
    uint16 views (their bits); PyTorch's are ``torch.bfloat16``."""
    views: dict[str, Any] = {}
    if isinstance(flat, np.ndarray):
        for spec in layout.specs:
            part = flat[spec.offset : spec.offset + spec.nbytes]
            views[spec.name] = part.view(DTYPES[spec.dtype][1]).reshape(spec.shape)
        return views
    import torch

    for spec in layout.specs:
        part = flat.narrow(0, spec.offset, spec.nbytes)
        views[spec.name] = part.view(getattr(torch, spec.dtype)).view(spec.shape)
    return views


# ---------- the inference side ----------------------------------------------------------------------------


class WeightVersion:
    """One version's parameters, every one a view of the producer's buffer; holds its lease until
    :meth:`release` (and until every view handed out is gone)."""

    def __init__(self, imported: Any, version: int, flat: Any, tensors: dict[str, Any]) -> None:
        self.version = version
        self.tensors = tensors
        self._imported = imported
        self._flat = flat

    def release(self) -> None:
        """Give the version back: the views this object holds go, then the import. Views kept
        elsewhere keep the producer's slot held until they go too."""
        self.tensors = {}
        self._flat = None
        if self._imported is not None:
            self._imported.release()
            self._imported = None


class WeightFollower:
    """Follows the versions of ``name`` on ``session``: :meth:`next` waits for a version newer than
    the last one returned and makes it usable. ``like``: ``"numpy"`` (host data) or ``"torch"``
    (CUDA data)."""

    def __init__(self, session: aib.Session, name: str, *, like: str = "numpy") -> None:
        if like not in ("numpy", "torch"):
            raise ValueError(f"like must be 'numpy' or 'torch', not {like!r}")
        self.session = session
        self.name = name
        self.like = like
        self.layout: Layout | None = None
        self.seen = 0  # the last version returned

    def _read_layout(self, timeout: float) -> Layout:
        with self.session.get(self.name + ".layout", wait=timeout) as imported:
            return Layout.from_batch(imported)

    def next(self, timeout: float | None = 30.0) -> WeightVersion:
        """The newest version after the last one returned (skipping any published meanwhile)."""
        imported = self.session.get_next(self.name, after=self.seen, timeout=timeout)
        try:
            if self.layout is None or self.layout.column not in imported.schema.names:
                # The trainer publishes a layout before any weights that use it.
                self.layout = self._read_layout(30.0 if timeout is None else timeout)
                if self.layout.column not in imported.schema.names:
                    raise LayoutError(
                        f"{self.name!r} version {imported.version} has columns {imported.schema.names}, "
                        f"the layout published names {self.layout.column!r}"
                    )
            flat = aib.column_arrays(imported, self.like, names=[self.layout.column])[self.layout.column]
            tensors = parameter_views(flat, self.layout)
        except BaseException:
            imported.release()
            raise
        version = imported.version
        if version is None:  # objects got by waiting always carry their version
            imported.release()
            raise RuntimeError(f"get_next returned {self.name!r} without a version")
        self.seen = version
        return WeightVersion(imported, version, flat, tensors)


class InferenceModel:
    """An inference process's model whose parameters are the views of one version at a time.

    :meth:`swap` installs a new version in one assignment (a reader of :attr:`parameters` sees the
    old mapping or the new one, never a mix) and retires the old version: on the host it is released
    at once; on the GPU once the work queued on the current stream before the swap has finished
    (:meth:`settle`, called before the next wait, waits for that)."""

    def __init__(self) -> None:
        self.parameters: Mapping[str, Any] = {}
        self.current: WeightVersion | None = None
        self._retired: list[tuple[WeightVersion, Any]] = []

    def swap(self, version: WeightVersion) -> None:
        old = self.current
        self.parameters = version.tensors
        self.current = version
        if old is None:
            return
        if self._on_gpu(old):
            import torch

            done = torch.cuda.Event()
            done.record()  # after every kernel queued on the old parameters on this stream
            self._retired.append((old, done))
        else:
            old.release()

    @staticmethod
    def _on_gpu(version: WeightVersion) -> bool:
        first = next(iter(version.tensors.values()), None)
        return first is not None and getattr(first, "is_cuda", False)

    def settle(self) -> None:
        """Release every retired version, waiting for the GPU work that read it to finish."""
        while self._retired:
            old, done = self._retired.pop(0)
            done.synchronize()
            old.release()

    def close(self) -> None:
        self.settle()
        self.parameters = {}
        if self.current is not None:
            self.current.release()
            self.current = None


def follow(
    follower: WeightFollower,
    model: InferenceModel,
    last_marker: int,
    *,
    timeout: float = 30.0,
    on_version: Callable[[WeightVersion], None] | None = None,
) -> list[int]:
    """Wait for versions until one carries ``last_marker``, swapping each into ``model`` and
    checking it is whole (:func:`version_marker`); ``on_version`` sees every version after its
    swap. Returns the marker of every version seen."""
    seen: list[int] = []
    while True:
        model.settle()  # nothing retired stays held while this process sleeps
        version = follower.next(timeout)
        model.swap(version)
        if on_version is not None:
            on_version(version)
        assert follower.layout is not None  # read by the first next()
        seen.append(version_marker(model.parameters, follower.layout))
        if seen[-1] == last_marker:
            return seen


# ---------- the demo: a trainer (this process) and an inference process ---------------------------------


def inference_process(path: str, name: str, device: str, steps: int, done: Any) -> None:
    """Follow the weights to the last step, checking that every version is whole."""
    like = "torch" if device == "cuda" else "numpy"
    with aib.connect(path, timeout=30.0, wait_for_publisher=True) as session:
        follower = WeightFollower(session, name, like=like)
        model = InferenceModel()
        try:
            seen = follow(follower, model, marker(steps - 1))
            layout = follower.layout
            assert layout is not None
            where = "GPU" if device == "cuda" else "host"
            print(
                f"inference: {len(seen)} versions, each whole ({len(layout.specs)} parameters at one step), "
                f"{steps - len(seen)} skipped, parameters viewed in place on the {where}",
                flush=True,
            )
        finally:
            model.close()
            done.set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--total-mib", type=float, default=16.0, help="model size in MiB (default 16)")
    parser.add_argument("--tensors", type=int, default=120, help="number of parameters (default 120)")
    parser.add_argument("--steps", type=int, default=40, help="training steps, one version each (default 40)")
    parser.add_argument("--slots", type=int, default=2, help="publication buffers (default 2)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tensors < 1 or args.total_mib <= 0 or args.slots < 2:
        parser.error("--steps and --tensors must be >= 1, --total-mib > 0, --slots >= 2")

    spec = model_spec(int(args.total_mib * (1 << 20)), args.tensors)
    dtypes = {name: dtype for name, dtype, _ in spec}
    if args.device == "cuda":
        import torch

        parameters: dict[str, Any] = {
            name: torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda:0")
            for name, dtype, shape in spec
        }
    else:
        parameters = host_parameters(spec)
    layout = Layout.plan(spec)

    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "trainer.sock")
    context = multiprocessing.get_context("spawn")  # CUDA never crosses a fork
    done = context.Event()
    child = context.Process(
        target=inference_process, args=(path, "weights", args.device, args.steps, done), daemon=True
    )
    child.start()
    started = time.perf_counter()
    try:
        with aib.Publisher(path) as publisher:
            weights = WeightPublisher(publisher, "weights", layout, device=args.device, slots=args.slots)
            before = aib.stats()  # after the layout's publish (a small host table, copied once)
            for step in range(args.steps):
                fill_marker(parameters, dtypes, step)  # the training step
                weights.publish(parameters)
            elapsed = time.perf_counter() - started
            print(
                f"trainer: published {args.steps} versions of {len(layout.specs)} parameters "
                f"({layout.total_bytes / (1 << 20):.1f} MiB) in {elapsed:.2f} s, "
                f"{weights.slot_waits} waits for a free slot, "
                f"{_copied_since(before)} bytes copied by the bridge",
                flush=True,
            )
            done.wait(120)  # serve until the inference process has the last version
            child.join(timeout=60)
            weights.close()
    finally:
        if child.is_alive():
            child.terminate()
        child.join()
        shutil.rmtree(directory, ignore_errors=True)
    if child.exitcode != 0:
        print(f"trainer: the inference process failed (exit code {child.exitcode})", file=sys.stderr)
        return 1
    return 0


def _copied_since(before: aib.BridgeStats) -> int:
    now = aib.stats()
    return now.host.copied_bytes - before.host.copied_bytes + now.cuda.copied_bytes - before.cuda.copied_bytes


if __name__ == "__main__":
    sys.exit(main())
