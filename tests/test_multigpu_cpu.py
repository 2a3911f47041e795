"""Several GPUs, the parts that need none: declarations, argument checks, error text, the copy plan,
peer access enabled once per pair (driver calls stubbed), the doctor's topology and list's GPU cell."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pyarrow as pa
import pytest
from helpers.counting import SessionCounts

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import cuda
from arrow_ipc_bridge.cli import doctor, listing
from arrow_ipc_bridge.cuda import _declarations, cross_gpu, nvml, peer
from arrow_ipc_bridge.errors import BridgeError, CudaError, InvalidArgumentError
from arrow_ipc_bridge.wire.metadata import SLOT_FIRST_REGION
from tests.helpers.session_rig import wait_for

# cuda.h (CUDA 13.0) values of what peer access uses
_PEER_VALUES = {
    "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED": 217,
    "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED": 704,
    "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED": 705,
    "CUDA_ERROR_TOO_MANY_PEERS": 711,
    "CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK": 1,
    "CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED": 2,
    "CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED": 3,
    "CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED": 4,
}
_UUIDS = {0: bytes(range(16)), 1: bytes(range(16, 32))}


def test_peer_constants_match_cuda_h() -> None:
    assert {name: getattr(_declarations, name) for name in _PEER_VALUES} == _PEER_VALUES


def test_peer_declarations_parse_with_their_values() -> None:
    ffi = cuda.build_ffi()
    elements = ffi.typeof("CUdevice_P2PAttribute").relements
    for name, value in _PEER_VALUES.items():
        if name.startswith("CU_DEVICE_P2P"):
            assert elements[name] == value
    cdef = cuda.cdef_source()
    for function in ("cuDeviceCanAccessPeer", "cuDeviceGetP2PAttribute", "cuCtxEnablePeerAccess"):
        assert f"CUresult {function}(" in cdef
    assert "CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext" in cdef


# ---------- the copy plan ---------------------------------------------------------------------------
def _ref(region: int, offset: int, length: int) -> tuple[int, int, int]:
    return (SLOT_FIRST_REGION + region, offset, length)


def test_copy_plan_merges_touching_buffers_and_skips_gaps() -> None:
    refs = [_ref(0, 0, 100), _ref(0, 100, 28), _ref(0, 1024, 64), _ref(0, 1050, 10), (0, 0, 999)]
    total, plan = cross_gpu.copy_plan(refs, [0x1000])
    lo, placed_at, runs = plan[0]
    assert lo == 0
    assert placed_at == 0
    assert runs == [(0, 128), (1024, 1088)]  # one copy per run, the gap between them not copied
    assert total == 1088


def test_copy_plan_keeps_each_buffers_alignment() -> None:
    """A region whose first buffer sits 64 bytes past a 256-byte boundary is placed 64 bytes past one."""
    refs = [_ref(0, 0, 10), _ref(1, 64, 8), _ref(1, 320, 8)]
    total, plan = cross_gpu.copy_plan(refs, [0x10000, 0x20000])
    _, placed0, _ = plan[0]
    lo1, placed1, runs1 = plan[1]
    assert placed0 == 0
    assert lo1 == 64
    assert placed1 % 256 == (0x20000 + 64) % 256
    assert placed1 >= 10
    assert runs1 == [(64, 72), (320, 328)]
    assert total == placed1 + (328 - 64)


def test_copy_plan_ignores_null_and_empty_buffers() -> None:
    total, plan = cross_gpu.copy_plan([(1, 0, 0), _ref(0, 8, 0)], [0])
    assert plan == {}
    assert total == 256  # never a zero-byte allocation


# ---------- peer access, with the driver calls stubbed -------------------------------------------------
@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """peer.py over a pretend driver with GPUs 0 and 1; ``calls`` counts cuCtxEnablePeerAccess."""
    state: dict[str, Any] = {"can": True, "rc": 0, "calls": []}
    monkeypatch.setattr(peer, "_device", lambda ordinal: ordinal)
    monkeypatch.setattr(peer, "device_uuid", lambda ordinal: _UUIDS[ordinal])
    monkeypatch.setattr(peer, "can_access_peer", lambda reader, owner: state["can"])

    def enable(reader: int, owner: int) -> int:
        state["calls"].append((reader, owner))
        return int(state["rc"])

    monkeypatch.setattr(peer, "_enable_from", enable)
    monkeypatch.setattr(peer, "_ENABLED", set())
    monkeypatch.setattr(peer._DRIVER, "ffi", cuda.build_ffi())  # names error codes without a library
    return state


def test_peer_access_is_enabled_once_per_pair(two_fake_gpus: dict[str, Any]) -> None:
    threads = [threading.Thread(target=peer.enable_peer_access, args=(1, 0)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    peer.enable_peer_access(1, 0)
    assert two_fake_gpus["calls"] == [(1, 0)]
    assert peer.peer_access_enabled(1, 0)
    assert not peer.peer_access_enabled(0, 1)  # the other direction is a pair of its own
    peer.enable_peer_access(0, 1)
    assert two_fake_gpus["calls"] == [(1, 0), (0, 1)]
    peer.enable_peer_access(1, 1)  # one GPU with itself: nothing to enable
    assert len(two_fake_gpus["calls"]) == 2


def test_access_enabled_by_another_library_counts(two_fake_gpus: dict[str, Any]) -> None:
    two_fake_gpus["rc"] = _declarations.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    peer.enable_peer_access(0, 1)
    assert peer.peer_access_enabled(0, 1)


def test_no_peer_path_names_both_gpus(two_fake_gpus: dict[str, Any]) -> None:
    two_fake_gpus["can"] = False
    with pytest.raises(peer.CudaError) as caught:
        peer.enable_peer_access(1, 0)
    assert caught.value.reason == "no_peer_access"
    error = caught.value
    text = str(error)
    assert "GPU 1 (GPU-10111213-1415-1617-1819-1a1b1c1d1e1f)" in text
    assert "GPU 0 (GPU-00010203-0405-0607-0809-0a0b0c0d0e0f)" in text
    assert "no peer path" in text
    assert "to_device(1)" in text  # what to do instead
    assert (error.reader, error.owner) == (1, 0)
    assert error.reader_uuid == "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"
    assert isinstance(error, BridgeError)
    assert isinstance(error, CudaError)
    assert two_fake_gpus["calls"] == []
    assert not peer.peer_access_enabled(1, 0)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is peer.CudaError
    assert str(again) == text
    assert again.owner_uuid == error.owner_uuid
    assert peer.try_enable_peer_access(1, 0) is False


def test_a_driver_refusal_is_a_peer_access_error_with_its_code(two_fake_gpus: dict[str, Any]) -> None:
    two_fake_gpus["rc"] = _declarations.CUDA_ERROR_TOO_MANY_PEERS
    with pytest.raises(peer.CudaError) as caught:
        peer.enable_peer_access(0, 1)
    assert caught.value.reason == "no_peer_access"
    assert caught.value.code == 711
    assert caught.value.call == "cuCtxEnablePeerAccess"
    assert "GPU 0 (" in str(caught.value)
    assert "GPU 1 (" in str(caught.value)
    assert not peer.peer_access_enabled(0, 1)


@pytest.mark.parametrize("bad", [True, 1.0, "0", None])
def test_ordinals_must_be_ints(bad: Any) -> None:
    with pytest.raises(TypeError, match="device ordinal"):
        peer.enable_peer_access(bad, 0)
    with pytest.raises(TypeError, match="device ordinal"):
        peer.can_access_peer(0, bad)


def test_peer_copies_check_their_arguments_before_the_driver() -> None:
    with pytest.raises(InvalidArgumentError):
        peer.copy_peer_async(-1, 0, 0x1000, 1, 8)
    with pytest.raises(InvalidArgumentError):
        peer.copy_peer_async(0x1000, 0, 0x2000, 1, -8)
    with pytest.raises(TypeError):
        peer.copy_peer_async(0x1000, "0", 0x2000, 1, 8)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        peer.copy_peer_async(0x1000, 0, 0x2000, 1, 8, stream=object())


# ---------- what a session does with data on another GPU ---------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cross_device": "copy"}, ValueError, "need reader_device"),
        ({"copy_stream": 0}, ValueError, "need reader_device"),
        ({"reader_device": -1}, ValueError, "reader_device"),
        ({"reader_device": True}, ValueError, "reader_device"),
        ({"reader_device": "1"}, ValueError, "reader_device"),
        ({"reader_device": 0, "cross_device": "move"}, ValueError, "cross_device must be one of"),
        ({"reader_device": 0, "copy_stream": 5}, ValueError, "only used with cross_device='copy'"),
        (
            {"reader_device": 0, "cross_device": "copy", "copy_stream": object()},
            InvalidArgumentError,
            "stream",
        ),
    ],
)
def test_session_reader_options_are_checked(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        aib.Session(**kwargs)


@pytest.mark.parametrize("mode", ["peer", "copy"])
def test_host_data_passes_a_reader_session_untouched(mode: str) -> None:
    batch = pa.record_batch({"x": [1, 2, 3]})
    with (
        aib.export(batch) as exported,
        aib.Session(reader_device=0, cross_device=mode) as session,
        session.import_message(exported.message, exported.fds) as imported,
    ):
        assert imported.device == "cpu"
        assert pa.record_batch(imported).equals(batch)


def test_to_device_and_in_place_refuse_host_data() -> None:
    batch = pa.record_batch({"x": [1, 2, 3]})
    with (
        aib.export(batch) as exported,
        aib.Session() as session,
        session.import_message(exported.message, exported.fds) as imported,
    ):
        with pytest.raises(BridgeError, match=r"needs GPU data.*aib.to_device"):
            imported.to_device(0)
        with pytest.raises(BridgeError, match="needs GPU data"):
            cross_gpu.grant_in_place(imported, 0)
        with pytest.raises(BridgeError, match="needs GPU data"):
            imported.readable_on(0)


# ---------- doctor's topology, list's GPU cell, NVML absent -------------------------------------------
def _pair(a_reads_b: bool, b_reads_a: bool, **extra: Any) -> doctor.PairFacts:
    facts: dict[str, Any] = {
        "a": 0,
        "b": 1,
        "uuid_a": "GPU-aaaa",
        "uuid_b": "GPU-bbbb",
        "a_reads_b": a_reads_b,
        "b_reads_a": b_reads_a,
        "performance_rank": 0,
        "native_atomics": True,
        "link": "NVLink (18 active links on the first GPU)",
    }
    return doctor.PairFacts(**(facts | extra))


@pytest.mark.parametrize(("count", "detail"), [(0, "no GPU: no pairs"), (1, "one GPU: no pairs")])
def test_topology_with_fewer_than_two_gpus(count: int, detail: str) -> None:
    assert doctor.topology_checks(count, []) == [doctor.Check("GPU topology", "info", detail)]


def test_topology_of_a_pair_with_peer_access_both_ways() -> None:
    (check,) = doctor.topology_checks(2, [_pair(True, True)])
    assert check.name == "GPU 0 <-> GPU 1"
    assert check.status == "ok"
    assert check.detail == (
        "peer access both ways, NVLink (18 active links on the first GPU), performance rank 0, "
        "native atomics (GPU-aaaa / GPU-bbbb)"
    )
    assert check.advice == ""


@pytest.mark.parametrize(
    ("a_reads_b", "b_reads_a", "words"),
    [(True, False, "peer access GPU 0 -> 1 only"), (False, False, "no peer access")],
)
def test_topology_without_peer_access_warns_and_says_what_to_do(
    a_reads_b: bool, b_reads_a: bool, words: str
) -> None:
    pair = _pair(a_reads_b, b_reads_a, performance_rank=None, native_atomics=None, link="PCIe via x")
    (check,) = doctor.topology_checks(2, [pair])
    assert check.status == "warn"
    assert check.detail == f"{words}, PCIe via x (GPU-aaaa / GPU-bbbb)"
    assert "to_device" in check.advice
    assert "cross_device='copy'" in check.advice


def test_nvml_missing_reads_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "_LIBRARY", "libnvidia-ml-absent.so.0")
    monkeypatch.setattr(nvml, "_state", {"lib": None, "failure": None})
    assert not nvml.nvml_available()
    link = nvml.gpu_link("GPU-aaaa", "GPU-bbbb")
    assert link.startswith("unknown (libnvidia-ml-absent.so.0 not usable")


def test_list_cell_names_the_gpu_by_ordinal_and_uuid() -> None:
    assert listing._device_cell({"device": "cpu"}) == "cpu"
    row = {"device": "cuda:1", "gpu_uuid": "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"}
    assert listing._device_cell(row) == "cuda:1 (GPU-00010203-0405-0607-0809-0a0b0c0d0e0f)"


def test_doctor_without_a_driver_prints_no_topology() -> None:
    if cuda.driver_available():
        pytest.skip("a CUDA driver is present here")
    assert doctor.cuda_checks() == [doctor.Check("CUDA", "info", "driver not found (host memory only)")]


class _SwapPlacement:
    """A reader placement that hands out another object for every import (as a cross-GPU mapping or
    copy does): the original is released, the new one comes from ``source``."""

    device = 1

    def __init__(self, source: aib.Session) -> None:
        self.source = source

    def place(self, imported: Any) -> Any:
        name = imported.name
        imported.release()
        return self.source.get(name)


def test_session_close_releases_what_the_reader_placement_handed_out(publisher: aib.Publisher) -> None:
    """Objects the reader placement makes in place of an import (Session(reader_device=...)) are the
    session's imports too: its close() releases them and their leases end."""
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    with aib.connect(publisher.path, timeout=5.0) as source:
        session = aib.connect(publisher.path, timeout=5.0)
        session._reader = _SwapPlacement(source)  # type: ignore[assignment]
        placed = [session.get("t") for _ in range(3)]
        assert all(not imported.released for imported in placed)
        # The placed objects' leases (the originals' RELEASEs reach the publisher asynchronously).
        assert wait_for(lambda: publisher.active_leases == 3, 5.0)
        session.close()
        assert all(imported.released for imported in placed)
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)


class _ReaderOpener:
    """Stands in for the opener's legacy opens in a reader's context (the driver's cuIpcOpenMemHandle):
    counts them; each call's owner reports its end in ``closed``."""

    def __init__(self) -> None:
        self.opens: list[int] = []
        self.closed: list[int] = []

    def open_legacy_for_reader(self, handles: list[Any], reader: int) -> tuple[list[int], Any]:
        from arrow_ipc_bridge._ffi import lib
        from arrow_ipc_bridge.runtime import reaper

        call = len(self.opens)
        self.opens.append(reader)
        owner = lib.aib_owner_new(reaper.register(lambda: self.closed.append(call)))
        return [0xB0000000 + 0x1000 * index for index in range(len(handles))], owner


def test_a_cross_gpu_re_get_reuses_what_the_first_get_granted_and_opened(
    publisher: aib.Publisher, two_fake_gpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-get of a remembered message on another GPU makes no driver call (no device lookup, no
    peer access, no handle open) and names the reader's pointers; forgetting the message drops
    what it kept and the reader's mappings close once the objects handed out are released."""
    counts = SessionCounts()
    from arrow_ipc_bridge.runtime import reaper
    from arrow_ipc_bridge.wire.metadata import REGION_HOST_FD

    devices: list[int] = []
    monkeypatch.setattr(cross_gpu, "_device", devices.append)
    # The host file regions of a host publication play the part of another process's legacy regions.
    monkeypatch.setattr(cross_gpu, "REGION_CUDA_LEGACY", REGION_HOST_FD)
    fake = _ReaderOpener()
    monkeypatch.setattr(cross_gpu, "opener", lambda: fake)
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    with aib.connect(publisher.path, timeout=5.0) as session:
        readables = []
        for _ in range(4):
            imported = session.get("t")
            imported._device_type = 2  # as if the producer's GPU 0 held it
            imported._device_id = 0
            readables.append(imported.readable_on(1))
            imported.release()
            if len(readables) == 2:  # the second get is the first of the remembered message
                calls = (len(devices), len(two_fake_gpus["calls"]), len(fake.opens))
        assert counts.remembered_gets >= 2
        # The third and fourth gets: nothing asked of the driver or the opener.
        assert (len(devices), len(two_fake_gpus["calls"]), len(fake.opens)) == calls
        for readable in readables:
            assert readable._mapped_on == (1, frozenset(range(readable._n_bases)))
            assert int(readable._bases[0]) == 0xB0000000
        for readable in readables:
            readable.release()
        reaper.drain()
        kept = len(fake.opens) - len(fake.closed)
        assert kept >= 1  # the remembered message's entry holds the reader's mappings
        session.forget()
        reaper.drain()
        assert wait_for(lambda: len(fake.closed) == len(fake.opens), 5.0)
