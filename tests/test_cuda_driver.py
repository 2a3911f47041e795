"""Tests of the CUDA driver layer, ``arrow_ipc_bridge.cuda`` (declarations, driver, devices, IPC kinds).

Without a GPU (CI): the module imports without opening the driver; the cffi declarations parse; every enum
value and struct layout matches ``cuda.h``; every driver-dependent call raises ``CudaError``; input is
validated before any driver call; caches and finalizers behave.

With a GPU (marker ``gpu``, skipped with a reason otherwise): pointer facts of CuPy memory, device identity by
UUID, context restoration, and each sharing mechanism across processes -- legacy IPC handles, interprocess
events ordering a consumer after a long-running producer kernel, IPC memory pools (fd over SCM_RIGHTS), VMM
exports -- plus managed memory, garbage handles and leak checks. Child processes use the ``spawn`` start
method (never fork after CUDA initialised), run top-level functions of this module, get a timeout on every
wait, and must exit with code 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import hashlib
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import pytest
from helpers import cuda_helpers

from arrow_ipc_bridge import cuda
from arrow_ipc_bridge.cuda import _declarations, _driver, devices, pools
from arrow_ipc_bridge.errors import (
    BridgeError,
    ClosedError,
    CopyRequiredError,
    CudaError,
    InvalidArgumentError,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT = 60.0  # seconds for any single wait on a child process

# ----------------------------------------------------------------------------------------------------------
# What cuda.h says. Source: CUDA 13.0 cuda.h as generated into NVIDIA/cuda-python
# cuda_bindings/cuda/bindings/cydriver.pxd.in ("generated with version 13.0.0"); the 12.x headers agree on
# every value used here. Written out independently of the module, so a typo on either side fails.
# ----------------------------------------------------------------------------------------------------------

CUDA_H_VALUES = {
    # CUresult
    "CUDA_SUCCESS": 0,
    "CUDA_ERROR_INVALID_VALUE": 1,
    "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NOT_INITIALIZED": 3,
    "CUDA_ERROR_DEINITIALIZED": 4,
    "CUDA_ERROR_STUB_LIBRARY": 34,
    "CUDA_ERROR_NO_DEVICE": 100,
    "CUDA_ERROR_INVALID_DEVICE": 101,
    "CUDA_ERROR_INVALID_CONTEXT": 201,
    "CUDA_ERROR_MAP_FAILED": 205,
    "CUDA_ERROR_ALREADY_MAPPED": 208,
    "CUDA_ERROR_NOT_MAPPED": 211,
    "CUDA_ERROR_OPERATING_SYSTEM": 304,
    "CUDA_ERROR_INVALID_HANDLE": 400,
    "CUDA_ERROR_NOT_FOUND": 500,
    "CUDA_ERROR_NOT_READY": 600,
    "CUDA_ERROR_ILLEGAL_ADDRESS": 700,
    "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED": 704,
    "CUDA_ERROR_CONTEXT_IS_DESTROYED": 709,
    "CUDA_ERROR_NOT_PERMITTED": 800,
    "CUDA_ERROR_NOT_SUPPORTED": 801,
    "CUDA_ERROR_UNKNOWN": 999,
    # CUpointer_attribute
    "CU_POINTER_ATTRIBUTE_CONTEXT": 1,
    "CU_POINTER_ATTRIBUTE_MEMORY_TYPE": 2,
    "CU_POINTER_ATTRIBUTE_BUFFER_ID": 7,
    "CU_POINTER_ATTRIBUTE_IS_MANAGED": 8,
    "CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL": 9,
    "CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE": 10,
    "CU_POINTER_ATTRIBUTE_RANGE_START_ADDR": 11,
    "CU_POINTER_ATTRIBUTE_RANGE_SIZE": 12,
    "CU_POINTER_ATTRIBUTE_MAPPED": 13,
    "CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES": 14,
    "CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE": 17,
    # CUmemorytype
    "CU_MEMORYTYPE_HOST": 1,
    "CU_MEMORYTYPE_DEVICE": 2,
    "CU_MEMORYTYPE_ARRAY": 3,
    "CU_MEMORYTYPE_UNIFIED": 4,
    # CUipcMem_flags, CUevent_flags
    "CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS": 1,
    "CU_EVENT_DEFAULT": 0,
    "CU_EVENT_BLOCKING_SYNC": 1,
    "CU_EVENT_DISABLE_TIMING": 2,
    "CU_EVENT_INTERPROCESS": 4,
    # CUmemAllocationHandleType
    "CU_MEM_HANDLE_TYPE_NONE": 0,
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR": 1,
    "CU_MEM_HANDLE_TYPE_WIN32": 2,
    "CU_MEM_HANDLE_TYPE_WIN32_KMT": 4,
    "CU_MEM_HANDLE_TYPE_FABRIC": 8,
    # CUmemAccess_flags
    "CU_MEM_ACCESS_FLAGS_PROT_NONE": 0,
    "CU_MEM_ACCESS_FLAGS_PROT_READ": 1,
    "CU_MEM_ACCESS_FLAGS_PROT_READWRITE": 3,
    # CUmemLocationType
    "CU_MEM_LOCATION_TYPE_INVALID": 0,
    "CU_MEM_LOCATION_TYPE_DEVICE": 1,
    "CU_MEM_LOCATION_TYPE_HOST": 2,
    "CU_MEM_LOCATION_TYPE_HOST_NUMA": 3,
    "CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT": 4,
    # CUmemAllocationType, CUmemAllocationGranularity_flags
    "CU_MEM_ALLOCATION_TYPE_INVALID": 0,
    "CU_MEM_ALLOCATION_TYPE_PINNED": 1,
    "CU_MEM_ALLOCATION_TYPE_MANAGED": 2,
    "CU_MEM_ALLOC_GRANULARITY_MINIMUM": 0,
    "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED": 1,
    # CUmemPool_attribute
    "CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES": 1,
    "CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC": 2,
    "CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES": 3,
    "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD": 4,
    "CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT": 5,
    "CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH": 6,
    "CU_MEMPOOL_ATTR_USED_MEM_CURRENT": 7,
    "CU_MEMPOOL_ATTR_USED_MEM_HIGH": 8,
    # CUdevice_attribute
    "CU_DEVICE_ATTRIBUTE_PCI_BUS_ID": 33,
    "CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID": 34,
    "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING": 41,
    "CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID": 50,
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 75,
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 76,
    "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 102,
    "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": 103,
    "CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED": 115,
    "CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES": 119,
    "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED": 125,
}

# sizeof on LP64 Linux, derived by hand from the cuda.h declarations (char[64] handles, 4-byte enums, ...).
STRUCT_SIZES = {
    "CUuuid": 16,
    "CUipcMemHandle": 64,
    "CUipcEventHandle": 64,
    "CUmemPoolPtrExportData": 64,
    "CUmemLocation": 8,  # {CUmemLocationType type; int id;}
    "CUmemAccessDesc": 12,  # {CUmemLocation location; CUmemAccess_flags flags;}
    "CUmemAllocationProp": 32,  # 4 + 4 + 8 + pointer 8 + allocFlags {u8, u8, u16, u8[4]} 8
    "CUmemPoolProps": 88,  # 4 + 4 + 8 + pointer 8 + size_t 8 + u16 + u8[54]
    "CUdeviceptr": 8,
    "CUmemGenericAllocationHandle": 8,
    "CUdevice": 4,
    "CUresult": 4,
    "CUcontext": 8,
    "CUevent": 8,
    "CUstream": 8,
    "CUmemoryPool": 8,
    "CUpointer_attribute": 4,
    "CUmemAllocationHandleType": 4,
    "CUmemAccess_flags": 4,
    "CUmemLocationType": 4,
    "CUmemAllocationType": 4,
    "CUmemPool_attribute": 4,
    "CUdevice_attribute": 4,
}

# (struct, field path, offset): field order as declared in cuda.h (13.0), offsets by the LP64 alignment rules.
STRUCT_OFFSETS = [
    ("CUmemLocation", ("type",), 0),
    ("CUmemLocation", ("id",), 4),
    ("CUmemAccessDesc", ("location",), 0),
    ("CUmemAccessDesc", ("flags",), 8),
    ("CUmemAllocationProp", ("type",), 0),
    ("CUmemAllocationProp", ("requestedHandleTypes",), 4),
    ("CUmemAllocationProp", ("location",), 8),
    ("CUmemAllocationProp", ("location", "id"), 12),
    ("CUmemAllocationProp", ("win32HandleMetaData",), 16),
    ("CUmemAllocationProp", ("allocFlags",), 24),
    ("CUmemAllocationProp", ("allocFlags", "compressionType"), 24),
    ("CUmemAllocationProp", ("allocFlags", "gpuDirectRDMACapable"), 25),
    ("CUmemAllocationProp", ("allocFlags", "usage"), 26),
    ("CUmemAllocationProp", ("allocFlags", "reserved"), 28),
    ("CUmemPoolProps", ("allocType",), 0),
    ("CUmemPoolProps", ("handleTypes",), 4),
    ("CUmemPoolProps", ("location",), 8),
    ("CUmemPoolProps", ("location", "id"), 12),
    ("CUmemPoolProps", ("win32SecurityAttributes",), 16),
    ("CUmemPoolProps", ("maxSize",), 24),
    ("CUmemPoolProps", ("usage",), 32),
    ("CUmemPoolProps", ("reserved",), 34),
]

# Functions cuda.h maps to a versioned symbol (#define cuX cuX_v2): only the versioned one may be declared.
VERSIONED_SYMBOLS = [
    "cuMemGetInfo_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8_v2",
    "cuIpcOpenMemHandle_v2",
    "cuEventDestroy_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
]


def _declared_functions(cdef: str) -> set[str]:
    return set(re.findall(r"^CUresult\s+(cu\w+)\s*\(", cdef, flags=re.MULTILINE))


# ==========================================================================================================
# Without a GPU
# ==========================================================================================================


def test_import_does_not_open_the_driver() -> None:
    """Importing the module parses nothing and opens nothing: it works on a machine without CUDA."""
    code = (
        "import arrow_ipc_bridge.cuda, arrow_ipc_bridge.cuda.placer, arrow_ipc_bridge.cuda.opener\n"
        "from arrow_ipc_bridge.cuda import _driver as c\n"
        "assert not c._DRIVER.loaded, 'driver loaded at import'\n"
        "assert c._DRIVER.ffi is None, 'declarations parsed at import'\n"
        "print('ok')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_cdef_parses_without_a_library() -> None:
    """The declarations parse into a cffi FFI without dlopen (catches C syntax errors on any machine)."""
    ffi = cuda.build_ffi()
    assert ffi.sizeof("CUipcMemHandle") == cuda.IPC_HANDLE_SIZE


@pytest.mark.parametrize(("ctype", "size"), sorted(STRUCT_SIZES.items()))
def test_type_sizes_match_cuda_h(ctype: str, size: int) -> None:
    """Handles are 64 bytes, CUuuid 16, CUmemPoolProps 88 ... exactly as cuda.h lays them out."""
    assert cuda.build_ffi().sizeof(ctype) == size


@pytest.mark.parametrize(("ctype", "fields", "offset"), STRUCT_OFFSETS)
def test_struct_offsets_match_cuda_h(ctype: str, fields: tuple[str, ...], offset: int) -> None:
    """Every field the module writes sits at the offset cuda.h gives it (the driver reads raw bytes)."""
    assert cuda.build_ffi().offsetof(ctype, *fields) == offset


def test_enum_constants_match_cuda_h() -> None:
    """The module's constants carry cuda.h's values."""
    wrong = {
        name: getattr(_declarations, name, None)
        for name, value in CUDA_H_VALUES.items()
        if getattr(_declarations, name, None) != value
    }
    assert not wrong


def test_cdef_enums_carry_the_same_values() -> None:
    """The C enums in the declarations are built from the same constants (one source for Python and C)."""
    ffi = cuda.build_ffi()
    for typedef, (_tag, members) in _declarations._ENUMS.items():
        elements = ffi.typeof(typedef).relements
        for name in members:
            assert elements[name] == CUDA_H_VALUES[name], (typedef, name)


def test_every_called_driver_function_is_declared() -> None:
    """Each ``lib.cuX`` the package calls (in ``cuda/`` or elsewhere, e.g. the Flight front's staging)
    is declared in the cdef -- ABI mode would only fail at call time. Every declared one is called, by
    the package or by the tests' helpers (``helpers/cuda_helpers.py``)."""
    package = Path(cuda.__file__).parent.parent
    modules = [*sorted(package.rglob("*.py")), Path(cuda_helpers.__file__)]
    source = "\n".join(module.read_text() for module in modules)
    called = set(re.findall(r"\blib\.(cu\w+)", source))
    declared = _declared_functions(cuda.cdef_source())
    assert called, "no driver calls found"
    assert called <= declared, sorted(called - declared)
    assert declared <= called, f"declared but never called: {sorted(declared - called)}"


@pytest.mark.parametrize("symbol", VERSIONED_SYMBOLS)
def test_versioned_symbols_are_declared(symbol: str) -> None:
    """Where the driver exports ``_v2``, the versioned symbol is declared and the legacy one is not."""
    declared = _declared_functions(cuda.cdef_source())
    assert symbol in declared
    assert symbol.removesuffix("_v2") not in declared


def test_forked_child_forgets_the_driver_table() -> None:
    """The C core's driver functions do not survive fork: a child forked after they were handed over
    finds none (its loops answer CUDA_ERROR_NOT_INITIALIZED, sync events are not queried), while
    the parent keeps them. No driver needed: a stand-in takes cuPointerGetAttributes' place."""
    from arrow_ipc_bridge._ffi import ffi, lib

    @ffi.callback("int(unsigned int, int *, void **, uint64_t)")
    def get_attributes(n: int, attributes: Any, data: Any, address: int) -> int:
        ffi.cast("uint64_t *", data[0])[0] = 2  # device memory (on device 0: the slots start zeroed)
        return 0

    def describe() -> int:
        """The device of one column (aib_cuda_devices_of): 0 when the driver table answers."""
        column = ffi.new("aib_cuda_column *", {"data": 0x1000, "length": 4})
        return int(
            lib.aib_cuda_devices_of(
                column, 1, ffi.new("int32_t *"), ffi.new("int32_t *"), ffi.new("size_t *")
            )
        )

    real = _driver._DRIVER.lib
    lib.aib_cuda_set_driver(
        ffi.new("aib_cuda_driver *", {"pointer_get_attributes": int(ffi.cast("uintptr_t", get_attributes))})
    )
    try:
        assert describe() == 0
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                os.write(write, describe().to_bytes(4, "little", signed=True))
            finally:
                os._exit(0)
        os.close(write)
        answer = os.read(read, 4)
        os.close(read)
        os.waitpid(pid, 0)
        assert int.from_bytes(answer, "little", signed=True) == 3  # CUDA_ERROR_NOT_INITIALIZED
        assert describe() == 0  # the parent keeps its table
    finally:
        restore = _driver.core_driver_table(real, _driver._DRIVER.ffi) if real is not None else None
        lib.aib_cuda_set_driver(restore if restore is not None else ffi.new("aib_cuda_driver *"))


def test_missing_library_raises_clear_cuda_error() -> None:
    """A missing driver library raises ``CudaError("CUDA driver <lib> not found: ...")``, each time."""
    driver = _driver._Driver("libcuda-does-not-exist.so.1")
    for _ in range(2):  # the failure is cached and re-raised as a fresh exception
        with pytest.raises(CudaError) as info:
            driver.load()
        assert str(info.value).startswith("CUDA driver libcuda-does-not-exist.so.1 not found: ")
        assert info.value.call == "dlopen"
    clone = pickle.loads(pickle.dumps(info.value))
    assert isinstance(clone, CudaError)
    assert clone.call == "dlopen"
    assert str(clone) == str(info.value)


def test_library_without_driver_symbols_is_refused_at_load() -> None:
    """A library lacking driver entry points (too old, or not libcuda at all) fails at load, naming them."""
    libc = ctypes.util.find_library("c")
    if libc is None:
        pytest.skip("no C library to stand in for an incomplete driver")
    with pytest.raises(CudaError, match=r"too old: it lacks .*cuInit") as info:
        _driver._Driver(libc).load()
    assert info.value.call == "dlopen"


def test_forked_child_gets_a_clear_error_instead_of_undefined_behaviour() -> None:
    """After a fork, a driver initialised by the parent refuses use and says to use 'spawn'."""
    driver = _driver._Driver("libcuda.so.1")
    driver.lib, driver.pid = object(), 12345  # as if this process had initialised CUDA ...
    driver.reset_after_fork()  # ... and then forked (what os.register_at_fork runs in the child)
    with pytest.raises(CudaError, match="spawn") as info:
        driver.load()
    assert info.value.code == _declarations.CUDA_ERROR_NOT_INITIALIZED


@pytest.mark.skipif(cuda.driver_available(), reason="a CUDA driver is available here")
def test_driver_dependent_calls_raise_cuda_error_without_driver() -> None:
    """Without a usable driver every call that needs it raises CudaError (never OSError or a crash)."""
    assert cuda.driver_available() is False
    with pytest.raises(CudaError, match=r"CUDA driver .* not found|cuInit"):
        cuda.load_driver()
    calls = [
        cuda.device_count,
        cuda.driver_version,
        lambda: cuda.device_uuid(0),
        lambda: cuda.device_name(0),
        lambda: cuda.ordinal_for_uuid(bytes(16)),
        lambda: cuda.device_context(0),
        lambda: cuda.synchronize(0),
        lambda: cuda.pointer_info(0x1000),
        lambda: cuda.read_device(0x1000, 16, device=0),
        lambda: cuda.ipc_get_mem_handle(0x1000),
        lambda: cuda.ipc_open_mem_handle(bytes(64), 0),
        lambda: cuda.open_ipc_event(bytes(64), 0),
        lambda: cuda.EventPool(0),
        lambda: cuda.Event(0),
        lambda: cuda.IpcMemoryPool(0),
        lambda: cuda.import_pool(0, 0),
        lambda: cuda.vmm_allocate(1 << 20, 0),
        lambda: cuda.vmm_import(0, 1 << 20, 0),
        lambda: cuda.vmm_export_fd(0x1000),
        lambda: cuda.pool_is_ipc_capable(0x1000),
        lambda: cuda.stream_wait_event(0, 0x1000),
    ]
    for call in calls:
        with pytest.raises(CudaError):
            call()


def test_error_message_names_call_code_and_driver_name() -> None:
    """A failed call reads ``cuX failed: NAME (code): description. hint``; details are kept as attributes."""
    error = _driver._format_error(
        "cuIpcOpenMemHandle_v2", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", "the handle is stale"
    )
    assert str(error) == (
        "cuIpcOpenMemHandle_v2 failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument. the handle is stale"
    )
    assert (error.call, error.code, error.name) == ("cuIpcOpenMemHandle_v2", 1, "CUDA_ERROR_INVALID_VALUE")
    assert isinstance(error, RuntimeError)
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.call, clone.code, clone.name, str(clone)) == (
        error.call,
        error.code,
        error.name,
        str(error),
    )
    default_hint = _driver._format_error(
        "cuDeviceGet", 101, "CUDA_ERROR_INVALID_DEVICE", "invalid device", None
    )
    assert "CUDA_VISIBLE_DEVICES" in str(default_hint)


@pytest.mark.parametrize(
    "call",
    [
        lambda: cuda.ipc_open_mem_handle(b"\0" * 10, 0),
        lambda: cuda.ipc_open_mem_handle(b"\0" * 65, 0),
        lambda: cuda.open_ipc_event(b"", 0),
        lambda: cuda.close_ipc_event(b"\0" * 63, 0),
        lambda: cuda.pointer_info(-1),
        lambda: cuda.pointer_info(1 << 64),
        lambda: cuda.read_device(-5, 1),
        lambda: cuda.read_device(0x1000, -1),
        lambda: cuda_helpers.memset_d8(0x1000, 256, 1),
        lambda: cuda.format_uuid(b"x"),
        lambda: cuda.import_pool(-1, 0),
        lambda: cuda.vmm_import(-1, 1, 0),
        lambda: cuda.vmm_import(3, 0, 0),
        lambda: cuda.IpcMemoryPool(0, max_size=-1),
        lambda: cuda.IpcMemoryPool(0, release_threshold=-1),
        lambda: cuda.LegacyHandleCache(0),
    ],
)
def test_malformed_input_is_rejected_before_any_driver_call(call: Any) -> None:
    """Wrong-sized handles, negative addresses and sizes raise InvalidArgumentError naming the
    argument, driver or not (invariant 1)."""
    with pytest.raises(InvalidArgumentError) as raised:
        call()
    assert raised.value.argument


def test_format_uuid_matches_nvidia_smi_spelling() -> None:
    """UUIDs print as nvidia-smi -L prints them."""
    uuid = bytes.fromhex("0123456789abcdef0011223344556677")
    assert cuda.format_uuid(uuid) == "GPU-01234567-89ab-cdef-0011-223344556677"


def test_legacy_handle_cache_fetches_once_and_evicts_lru() -> None:
    """Handles are fetched once per buffer_id, evicted least-recently-used, and dropped by invalidate()."""
    fetched: list[int] = []

    def fetch(base: int) -> bytes:
        fetched.append(base)
        return base.to_bytes(8, "little") * 8

    cache = cuda.LegacyHandleCache(2, fetch=fetch)
    assert cache.get(0x1000, 1) == (0x1000).to_bytes(8, "little") * 8
    assert cache.get(0x1000, 1) == (0x1000).to_bytes(8, "little") * 8
    assert fetched == [0x1000]
    assert (cache.hits, cache.misses) == (1, 1)
    cache.get(0x2000, 2)
    cache.get(0x1000, 1)  # 1 becomes most recent
    cache.get(0x3000, 3)  # evicts 2
    assert 2 not in cache
    assert 1 in cache
    assert len(cache) == 2
    cache.invalidate(1)
    cache.invalidate(12345)  # absent: no-op
    assert 1 not in cache
    cache.get(0x1000, 1)
    assert fetched == [0x1000, 0x2000, 0x3000, 0x1000]
    cache.clear()
    assert len(cache) == 0


def test_stream_arguments_accept_framework_streams() -> None:
    """Streams may be ints, CuPy streams (.ptr), PyTorch streams (.cuda_stream) or __cuda_stream__ objects."""

    class CupyLike:
        ptr = 0x1234

    class TorchLike:
        cuda_stream = 0x5678

    class Protocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0x9ABC)

    assert _driver._stream_value(0) == 0
    assert _driver._stream_value(None) == 0
    assert _driver._stream_value(7) == 7
    assert _driver._stream_value(CupyLike()) == 0x1234
    assert _driver._stream_value(TorchLike()) == 0x5678
    assert _driver._stream_value(Protocol()) == 0x9ABC
    for bad in (True, "0", -1, object()):
        with pytest.raises(InvalidArgumentError):
            _driver._stream_value(bad)


class _FlakyResource(_driver._DriverResource):
    def __init__(self) -> None:
        self.releases = 0
        self._closed = False

    def _release(self) -> None:
        self.releases += 1
        raise CudaError("cuFake failed", call="cuFake", code=999, name="CUDA_ERROR_UNKNOWN")


def test_close_is_idempotent_and_finalizer_warns_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() releases once (even when that fails); an unclosed object warns from __del__, never raises."""
    monkeypatch.setattr(_driver, "_usable_in_this_process", lambda: True)
    resource = _FlakyResource()
    with pytest.raises(CudaError):
        resource.close()
    resource.close()
    assert resource.releases == 1
    assert resource.closed

    leaked = _FlakyResource()
    with pytest.warns(ResourceWarning, match="_FlakyResource was not closed"):
        leaked.__del__()  # what the garbage collector calls; the failing release must not escape
    assert leaked.releases == 1
    assert leaked.closed


def test_closed_resources_refuse_use() -> None:
    """Using a closed pool raises ClosedError, not a driver call on a dead handle."""
    pool = cuda.EventPool.__new__(cuda.EventPool)  # never opened: the class default says closed
    with pytest.raises(ClosedError) as raised:
        pool.acquire()
    assert (raised.value.reason, raised.value.what) == ("closed", "EventPool")


# ==========================================================================================================
# With a GPU
# ==========================================================================================================


@pytest.fixture(scope="module")
def cupy(cuda_device: int) -> Any:
    """CuPy, on the test device."""
    module = pytest.importorskip("cupy")
    module.cuda.Device(cuda_device).use()
    return module


@pytest.fixture(scope="module")
def numpy() -> Any:
    return pytest.importorskip("numpy")


# --- child processes -------------------------------------------------------------------------------------
# Children are started with "spawn" and run one of the top-level functions below through _child_entry. They
# send ("msg", payload) while running and ("ok", result) or ("error", traceback) at the end.


def _child_entry(conn: Any, func_name: str, args: tuple[Any, ...]) -> None:
    try:
        result = globals()[func_name](conn, *args)
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class _Child:
    """A spawned child running ``func(conn, *args)``; leaving the ``with`` joins it and checks its exit."""

    def __init__(self, func: Any, *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child_entry, args=(child_conn, func.__name__, args), daemon=True)
        self.proc.start()
        child_conn.close()

    def send(self, value: Any) -> None:
        self.conn.send(value)

    def send_fd(self, fd: int) -> None:
        """Pass a file descriptor with SCM_RIGHTS (the child calls reduction.recv_handle)."""
        reduction.send_handle(self.conn, fd, self.proc.pid)

    def _recv(self) -> tuple[str, Any]:
        if not self.conn.poll(CHILD_TIMEOUT):
            raise AssertionError(f"child {self.proc.pid} sent nothing within {CHILD_TIMEOUT} s")
        try:
            kind, value = self.conn.recv()
        except EOFError:  # it died without a word (crash in the driver, killed, failed to start)
            self.proc.join(CHILD_TIMEOUT)
            raise AssertionError(
                f"child {self.proc.pid} exited with code {self.proc.exitcode} and no result"
            ) from None
        if kind == "error":
            raise AssertionError(f"child failed:\n{value}")
        return kind, value

    def message(self) -> Any:
        kind, value = self._recv()
        assert kind == "msg", (kind, value)
        return value

    def result(self) -> Any:
        kind, value = self._recv()
        assert kind == "ok", (kind, value)
        return value

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # the test already failed: stop the child quickly, keep the original error
            self.conn.close()  # a child blocked on recv() gets EOFError and exits
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            return
        self.proc.join(CHILD_TIMEOUT)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
            raise AssertionError(f"child {self.proc.pid} did not exit within {CHILD_TIMEOUT} s")
        self.conn.close()
        assert self.proc.exitcode == 0, f"child exit code {self.proc.exitcode}"


def _cudamalloc_array(cupy: Any, count: int, dtype: Any) -> Any:
    """A CuPy array over its own cudaMalloc allocation: legacy-IPC capable whatever CuPy's allocator is."""
    memory = cupy.cuda.Memory(count * cupy.dtype(dtype).itemsize)
    return cupy.ndarray((count,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child_read_legacy(conn: Any, uuid: bytes, handle: bytes, offset: int, nbytes: int) -> str:
    device = cuda.ordinal_for_uuid(uuid)
    base = cuda.ipc_open_mem_handle(handle, device)
    try:
        info = cuda.pointer_info(base)
        assert info is not None
        assert info.device == device
        return _sha256(cuda.read_device(base + offset, nbytes, device=device))
    finally:
        cuda.ipc_close_mem_handle(base, device=device)


def _child_wait_then_read(
    conn: Any, uuid: bytes, handle: bytes, where: tuple[int, int], word: int
) -> dict[str, Any]:
    offset, nbytes = where
    device = cuda.ordinal_for_uuid(uuid)
    base = cuda.ipc_open_mem_handle(handle, device)
    try:
        conn.send(("msg", "ready"))
        if not conn.poll(CHILD_TIMEOUT):
            raise TimeoutError("no event handle from the parent")
        event = cuda.open_ipc_event(conn.recv(), device)
        pending_before = not cuda.event_query(event)
        cuda.stream_wait_event(0, event, device=device)
        data = cuda.read_device(base + offset, nbytes, device=device)  # legacy stream: ordered after the wait
        done_after = cuda.event_query(event)
        expected = word.to_bytes(4, "little") * (nbytes // 4)
        first_bad = None
        if data != expected:
            first_bad = next(i for i in range(0, nbytes, 4) if data[i : i + 4] != expected[i : i + 4])
        return {
            "pending_before": pending_before,
            "done_after": done_after,
            "equal": data == expected,
            "first_bad": first_bad,
        }
    finally:
        cuda.ipc_close_mem_handle(base, device=device)
        cuda.clear_ipc_event_cache()


def _child_event_cycles(conn: Any, uuid: bytes, handle: bytes, cycles: int) -> dict[str, Any]:
    device = cuda.ordinal_for_uuid(uuid)
    for _ in range(10):  # warm-up: the first open sets up the process's IPC machinery
        cuda.open_ipc_event(handle, device)
        cuda.close_ipc_event(handle, device)
    fds0, rss0, free0 = _fd_count(), _rss_bytes(), cuda_helpers.mem_get_info(device)[0]
    for _ in range(cycles):
        event = cuda.open_ipc_event(handle, device)
        cuda.event_synchronize(event)
        assert cuda.close_ipc_event(handle, device)
    fds1, rss1, free1 = _fd_count(), _rss_bytes(), cuda_helpers.mem_get_info(device)[0]
    first = cuda.open_ipc_event(handle, device)
    same = all(cuda.open_ipc_event(handle, device) == first for _ in range(cycles))
    cached = cuda.ipc_event_cache_size()
    cuda.clear_ipc_event_cache()
    return {
        "fds": (fds0, fds1),
        "rss_growth": rss1 - rss0,
        "device_free_drop": free0 - free1,
        "cached_opens_same": same,
        "cache_size": cached,
        "cache_size_after_clear": cuda.ipc_event_cache_size(),
    }


def _receive_pool(conn: Any, uuid: bytes) -> tuple[cuda.ImportedPool, int]:
    """The pool whose fd the parent sends, imported on the GPU named by ``uuid`` (the fd is closed:
    the driver keeps its own reference), and that GPU's ordinal here."""
    fd = reduction.recv_handle(conn)
    device = cuda.ordinal_for_uuid(uuid)
    try:
        return cuda.import_pool(fd, device), device
    finally:
        os.close(fd)


def _child_read_pool(conn: Any, uuid: bytes, export_data: bytes, nbytes: int) -> str:
    pool, device = _receive_pool(conn, uuid)
    with pool:
        ptr = pool.import_pointer(export_data)
        assert pool.imported_count == 1
        digest = _sha256(cuda.read_device(ptr, nbytes, device=device))
        pool.free_imported(ptr)
        assert pool.imported_count == 0
        assert not cuda.pool_is_ipc_capable(pool.handle)  # an imported pool cannot be exported again
    return digest


def _child_read_pool_batch(conn: Any, uuid: bytes, export_datas: list[bytes], nbytes: int) -> list[str]:
    pool, device = _receive_pool(conn, uuid)
    with pool:
        # All or nothing: a corrupted record in the middle leaves nothing imported behind.
        corrupted = [export_datas[0], bytes(64), export_datas[1]]
        with pytest.raises(CudaError, match="cuMemPoolImportPointer"):
            pool.import_pointers(corrupted)
        assert pool.imported_count == 0
        pointers = pool.import_pointers(export_datas)
        assert pool.imported_count == len(export_datas) == len(set(pointers))
        digests = [_sha256(cuda.read_device(ptr, nbytes, device=device)) for ptr in pointers]
        # A batch free checks every pointer first: one never imported (or given twice) frees none.
        for bad in ([*pointers, 0x1000], [pointers[0], pointers[0]]):
            with pytest.raises(InvalidArgumentError, match="not imported from this pool"):
                pool.free_imported_many(bad)
            assert pool.imported_count == len(pointers)
        pool.free_imported(pointers[0])
        pool.free_imported_many(pointers[1:])
        assert pool.imported_count == 0
    return digests


def _child_read_vmm(conn: Any, uuid: bytes, size: int, nbytes: int) -> str:
    fd = reduction.recv_handle(conn)
    device = cuda.ordinal_for_uuid(uuid)
    try:
        mapping = cuda.vmm_import(fd, size, device)
    finally:
        os.close(fd)
    try:
        assert mapping.size >= size
        return _sha256(cuda.read_device(mapping.ptr, nbytes, device=device))
    finally:
        mapping.close()
        mapping.close()  # idempotent


def _child_garbage_handles(conn: Any, uuid: bytes) -> list[tuple[str, str, Any]]:
    device = cuda.ordinal_for_uuid(uuid)
    outcomes: list[tuple[str, str, Any]] = []
    for label, handle in (("zeros", bytes(64)), ("random", os.urandom(64)), ("ones", b"\xff" * 64)):
        try:
            ptr = cuda.ipc_open_mem_handle(handle, device)
        except CudaError as exc:
            outcomes.append((f"mem/{label}", "CudaError", (exc.call, exc.code, exc.name)))
        else:
            cuda.ipc_close_mem_handle(ptr, device=device)
            outcomes.append((f"mem/{label}", "opened", ptr))
        try:
            event = cuda.open_ipc_event(handle, device)
        except CudaError as exc:
            outcomes.append((f"event/{label}", "CudaError", (exc.call, exc.code, exc.name)))
        else:
            outcomes.append((f"event/{label}", "opened", event))
            cuda.close_ipc_event(handle, device)
    return outcomes


# --- the GPU tests ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_device_identity_round_trips_through_uuid(cuda_device: int) -> None:
    """A device's UUID maps back to its ordinal; an unknown UUID raises CudaError (reason
    "not_visible") naming it."""
    uuid = cuda.device_uuid(cuda_device)
    assert len(uuid) == 16
    assert cuda.ordinal_for_uuid(uuid) == cuda_device
    assert cuda.device_name(cuda_device)
    assert cuda.driver_version() >= 12000
    stranger = bytes(15) + b"\x01"
    with pytest.raises(CudaError, match=re.escape(cuda.format_uuid(stranger))) as info:
        cuda.ordinal_for_uuid(stranger)
    assert info.value.uuid == cuda.format_uuid(stranger)  # type: ignore[attr-defined]
    assert info.value.reason == "not_visible"
    with pytest.raises(CudaError, match="CUDA_VISIBLE_DEVICES"):
        cuda.device_uuid(cuda.device_count())


@pytest.mark.gpu
def test_device_context_pushes_the_primary_context_and_restores(cuda_device: int) -> None:
    """device_context makes the primary context current and restores the previous one, per thread."""
    primary = int(_driver._ffi().cast("uintptr_t", devices._primary_context(cuda_device)))

    def in_fresh_thread() -> tuple[int, int, int, int]:
        before = cuda_helpers.current_context()
        with cuda.device_context(cuda_device):
            inside = cuda_helpers.current_context()
            with cuda.device_context(cuda_device):
                nested = cuda_helpers.current_context()
        return before, inside, nested, cuda_helpers.current_context()

    with ThreadPoolExecutor(1) as pool:
        before, inside, nested, after = pool.submit(in_fresh_thread).result(timeout=CHILD_TIMEOUT)
    assert (before, inside, nested, after) == (0, primary, primary, 0)


@pytest.mark.gpu
def test_primary_context_is_the_one_cupy_uses(cupy: Any, cuda_device: int) -> None:
    """CuPy (the runtime) works in the same primary context, so its pointers are valid in ours."""
    cupy.zeros(1, dtype=cupy.uint8)  # makes CuPy initialise the runtime on this thread
    primary = int(_driver._ffi().cast("uintptr_t", devices._primary_context(cuda_device)))
    assert cuda_helpers.current_context() == primary
    with cuda.device_context(cuda_device):
        assert cuda_helpers.current_context() == primary
    assert cuda_helpers.current_context() == primary


@pytest.mark.gpu
def test_pointer_info_describes_cupy_memory(cupy: Any, cuda_device: int) -> None:
    """pointer_info gives device, range, buffer id and legacy IPC capability; a slice shares them."""
    array = _cudamalloc_array(cupy, 1 << 20, cupy.uint8)
    ptr = array.data.ptr
    info = cuda.pointer_info(ptr)
    assert info is not None
    assert info.memory_type == "device"
    assert info.device == cuda_device
    assert not info.is_managed
    assert info.base <= ptr
    assert ptr + array.nbytes <= info.base + info.size
    assert info.buffer_id != 0
    assert info.legacy_ipc_capable
    assert info.mempool == 0

    view = array[4096:]
    info_view = cuda.pointer_info(view.data.ptr)
    assert info_view is not None
    assert (info_view.base, info_view.size, info_view.buffer_id) == (info.base, info.size, info.buffer_id)


@pytest.mark.gpu
def test_pointer_info_of_host_memory_is_none(cuda_device: int) -> None:
    """Plain host memory and address 0 are not CUDA memory: pointer_info returns None."""
    buffer = ctypes.create_string_buffer(4096)
    assert cuda.pointer_info(ctypes.addressof(buffer)) is None
    assert cuda.pointer_info(0) is None


@pytest.mark.gpu
def test_copies_round_trip(cupy: Any, cuda_device: int) -> None:
    """write_device/read_device/memset_d8/memcpy_* move the bytes they say."""
    array = cupy.zeros(4096, dtype=cupy.uint8)
    ptr = array.data.ptr
    payload = bytes(range(256)) * 16
    cuda_helpers.write_device(ptr, payload)
    assert cuda.read_device(ptr, len(payload)) == payload
    assert bytes(array.get().tobytes()) == payload
    cuda_helpers.memset_d8(ptr + 100, 7, 10)
    host = ctypes.create_string_buffer(20)
    cuda.memcpy_dtoh(ctypes.addressof(host), ptr + 95, 20)
    assert host.raw == payload[95:100] + b"\x07" * 10 + payload[110:115]
    source = ctypes.create_string_buffer(b"abcdefgh", 8)
    cuda.memcpy_htod(ptr, ctypes.addressof(source), 8, device=cuda_device)
    assert cuda.read_device(ptr, 8, device=cuda_device) == b"abcdefgh"


@pytest.mark.gpu
def test_legacy_ipc_handle_opens_in_another_process(cupy: Any, cuda_device: int) -> None:
    """A child opens the legacy handle of CuPy memory and reads exactly the parent's bytes at the offset."""
    whole = _cudamalloc_array(cupy, 1 << 18, cupy.uint32)
    whole[...] = cupy.arange(1 << 18, dtype=cupy.uint32)
    array = whole[1000:]  # a view: the handle opens at the allocation's base, the child adds the offset
    cupy.cuda.Device(cuda_device).synchronize()
    cache = cuda.LegacyHandleCache()
    handle, info = cache.get_for_pointer(array.data.ptr)
    assert len(handle) == 64
    assert cache.get(info.base, info.buffer_id) == handle
    assert cache.hits == 1
    offset = array.data.ptr - info.base
    assert offset == 4000
    expected = _sha256(array.get().tobytes())
    with _Child(_child_read_legacy, cuda.device_uuid(cuda_device), handle, offset, array.nbytes) as child:
        assert child.result() == expected
    del array, whole


_SPIN_SOURCE = r"""
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
"""
_SPIN_NS = 500_000_000  # the consumer must look while the producer is still busy
_WORD = 0xA5A5A5A5


@pytest.mark.gpu
def test_ipc_event_orders_consumer_after_long_producer_kernel(
    cupy: Any, numpy: Any, cuda_device: int
) -> None:
    """The consumer waits on the producer's IPC event and reads the final data, not what was there before."""
    if not cuda.device_capabilities(cuda_device).ipc_events:
        pytest.skip("device does not support interprocess events")
    array = _cudamalloc_array(cupy, 1 << 22, cupy.uint32)  # 16 MiB
    try:
        spin = cupy.RawKernel(_SPIN_SOURCE, "spin_ns")
        spin((1,), (1,), (numpy.uint64(0),))  # compile and load now, not inside the timed section
        array.fill(numpy.uint32(1))
    except Exception as exc:  # NVRTC missing or similar: not what this test is about
        pytest.skip(f"cannot compile a CuPy kernel here: {exc}")
    array.fill(numpy.uint32(0))
    cupy.cuda.Device(cuda_device).synchronize()
    info = cuda.pointer_info(array.data.ptr)
    assert info is not None
    handle = cuda.ipc_get_mem_handle(info.base, device=cuda_device)
    offset = array.data.ptr - info.base

    events = cuda.EventPool(cuda_device)
    event = events.acquire()
    stream = cupy.cuda.Stream(non_blocking=True)
    uuid = cuda.device_uuid(cuda_device)
    with _Child(_child_wait_then_read, uuid, handle, (offset, array.nbytes), _WORD) as child:
        assert child.message() == "ready"
        with stream:
            spin((1,), (1,), (numpy.uint64(_SPIN_NS),))
            array.fill(numpy.uint32(_WORD))
        event.record(stream)
        child.send(event.ipc_handle())
        result = child.result()
    stream.synchronize()
    events.release(event)
    events.close()
    assert result["equal"], f"consumer read stale data (first bad byte {result['first_bad']})"
    assert result["done_after"]
    assert result["pending_before"], "the producer finished before the consumer looked: spin too short"


@pytest.mark.gpu
def test_ipc_event_open_close_cycles_do_not_leak(cuda_device: int) -> None:
    """1000 open/close cycles of one IPC event handle leave fds, memory and the cache where they were."""
    if not cuda.device_capabilities(cuda_device).ipc_events:
        pytest.skip("device does not support interprocess events")
    with cuda.EventPool(cuda_device) as events:
        event = events.acquire()
        event.record(0)
        event.synchronize()
        with _Child(_child_event_cycles, cuda.device_uuid(cuda_device), event.ipc_handle(), 1000) as child:
            result = child.result()
        events.release(event)
    fds_before, fds_after = result["fds"]
    assert fds_after == fds_before, result
    assert result["rss_growth"] < 32 << 20, result
    assert result["device_free_drop"] < 64 << 20, result
    assert result["cached_opens_same"], result
    assert result["cache_size"] == 1, result
    assert result["cache_size_after_clear"] == 0, result


@pytest.mark.gpu
def test_event_pool_reuses_one_event_for_sequential_hand_offs(cuda_device: int) -> None:
    """Acquire/record/release 1000 times creates one event; its IPC handle is fetched once."""
    with cuda.EventPool(cuda_device) as events:
        handles = set()
        for _ in range(1000):
            event = events.acquire()
            event.record(0)
            handles.add(id(event.ipc_handle()))
            events.release(event)
        assert events.created == 1
        assert len(handles) == 1
        assert events.idle == 1
        assert events.leased == 0
        event = events.acquire()
        event.record(0)
        event.synchronize()
        assert event.query()
        assert cuda.event_query(event.handle)
    assert event.closed  # closing the pool destroyed the leased event too
    with pytest.raises(ClosedError) as raised:
        event.record(0)
    assert raised.value.reason == "closed"  # the event was closed with its pool
    with (
        cuda.EventPool(cuda_device) as other,
        cuda.Event(cuda_device) as stranger,
        pytest.raises(BridgeError),
    ):
        other.release(stranger)


@pytest.mark.gpu
def test_ipc_memory_pool_shares_allocations_across_processes(cuda_device: int) -> None:
    """A child imports the pool from an fd (SCM_RIGHTS) and one pointer from its 64-byte export data."""
    if not cuda.device_capabilities(cuda_device).mempool_posix_fd:
        pytest.skip("device does not support POSIX-fd memory pools")
    payload = os.urandom(3 << 20)
    with cuda.IpcMemoryPool(cuda_device) as pool:
        ptr = pool.allocate(len(payload))
        # legacy stream: ordered after the allocation
        cuda_helpers.write_device(ptr, payload, device=cuda_device)
        info = cuda.pointer_info(ptr)
        assert info is not None
        assert info.mempool == pool.handle
        assert cuda_helpers.pool_of_pointer(ptr) == pool.handle
        assert cuda.pool_is_ipc_capable(pool.handle)
        assert pools._export_probe(pool.handle)  # what other pools get asked: the driver agrees too
        assert pool.used_bytes >= len(payload)
        export_data = pool.export_pointer(ptr)
        assert len(export_data) == 64
        fd = pool.export_pool_fd()
        try:
            with _Child(_child_read_pool, cuda.device_uuid(cuda_device), export_data, len(payload)) as child:
                child.send_fd(fd)
                assert child.result() == _sha256(payload)
        finally:
            os.close(fd)
        pool.free(ptr)
        cuda.synchronize(cuda_device)
    assert pool.closed
    assert not cuda.pool_is_ipc_capable(0)


@pytest.mark.gpu
def test_pool_pointers_import_in_one_batch(cuda_device: int) -> None:
    """``import_pointers`` (the consumer's per-message batch, looped in the C core) maps every
    allocation, in order, and imports nothing when one record is bad."""
    if not cuda.device_capabilities(cuda_device).mempool_posix_fd:
        pytest.skip("device does not support POSIX-fd memory pools")
    payloads = [os.urandom(3 << 20) for _ in range(5)]
    with cuda.IpcMemoryPool(cuda_device) as pool:
        pointers = [pool.allocate(len(p)) for p in payloads]
        for ptr, payload in zip(pointers, payloads, strict=True):
            cuda_helpers.write_device(ptr, payload, device=cuda_device)
        # Pointers exported before the pool's fd: the driver refuses that unless the pool was
        # shared once, which export_pointer does for us.
        export_datas = [pool.export_pointer(ptr) for ptr in pointers]
        fd = pool.export_pool_fd()
        try:
            uuid = cuda.device_uuid(cuda_device)
            with _Child(_child_read_pool_batch, uuid, export_datas, len(payloads[0])) as child:
                child.send_fd(fd)
                assert child.result() == [_sha256(p) for p in payloads]
        finally:
            os.close(fd)
        for ptr in pointers:
            pool.free(ptr)
        cuda.synchronize(cuda_device)


@pytest.mark.gpu
def test_cupy_allocator_serves_pool_shareable_memory(cupy: Any, cuda_device: int) -> None:
    """With the allocator installed, CuPy arrays live in an IPC-capable pool and compute normally."""
    if not cuda.device_capabilities(cuda_device).mempool_posix_fd:
        pytest.skip("device does not support POSIX-fd memory pools")
    get_allocator = getattr(cupy.cuda, "get_allocator", None) or cupy.cuda.memory.get_allocator
    previous = get_allocator()
    allocator = cuda.cupy_allocator(cuda_device)
    try:
        cupy.cuda.set_allocator(allocator)
        x = cupy.arange(1 << 18, dtype=cupy.float32)  # 1 MiB, the size the GPU benchmark shares
        cupy.cuda.runtime.deviceSynchronize()  # a stream-ordered allocation exports once it ran
        info = cuda.pointer_info(x.data.ptr)
        assert info is not None
        assert info.mempool == allocator.pool.handle
        assert cuda.pool_is_ipc_capable(info.mempool)
        # The export the end-to-end test relies on (tests/test_gpu.py::
        # test_cupy_pool_allocator_arrays_travel_as_pool_regions): it used to fail here because the
        # driver wants the pool shared once first, which export_pointer now does.
        assert len(allocator.pool.export_pointer(x.data.ptr)) == 64
        assert float((x[:1000] * 2).sum()) == 999_000.0
        empty = cupy.empty(0, dtype=cupy.float32)
        assert empty.size == 0
        del x, empty
        gc.collect()
    finally:
        cupy.cuda.set_allocator(previous)
        cupy.cuda.Device(cuda_device).synchronize()
    allocator.pool.close()


@pytest.mark.gpu
def test_vmm_allocation_shares_across_processes(cuda_device: int) -> None:
    """A child imports a VMM allocation from its POSIX fd, maps it and reads the parent's bytes."""
    caps = cuda.device_capabilities(cuda_device)
    if not (caps.vmm and caps.vmm_posix_fd):
        pytest.skip("device does not support VMM with POSIX fd handles")
    payload = os.urandom((5 << 20) + 123)
    with cuda.vmm_allocate(len(payload), cuda_device) as allocation:
        granularity = cuda.vmm_granularity(cuda_device)
        assert allocation.size % granularity == 0
        assert allocation.size >= len(payload)
        cuda_helpers.write_device(allocation.ptr, payload, device=cuda_device)
        info = cuda.pointer_info(allocation.ptr)
        assert info is not None
        assert info.memory_type == "device"
        assert info.device == cuda_device
        assert not info.legacy_ipc_capable
        fd = cuda.vmm_export_fd(allocation.ptr, device=cuda_device)
        try:
            uuid = cuda.device_uuid(cuda_device)
            with _Child(_child_read_vmm, uuid, allocation.size, len(payload)) as child:
                child.send_fd(fd)
                assert child.result() == _sha256(payload)
        finally:
            os.close(fd)
    assert allocation.closed
    allocation.close()  # idempotent


@pytest.mark.gpu
def test_vmm_allocation_reports_posix_fd_handle_type(cuda_device: int) -> None:
    """CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES of a POSIX-fd VMM allocation includes POSIX fds."""
    caps = cuda.device_capabilities(cuda_device)
    if not (caps.vmm and caps.vmm_posix_fd):
        pytest.skip("device does not support VMM with POSIX fd handles")
    with cuda.vmm_allocate(1, cuda_device) as allocation:
        info = cuda.pointer_info(allocation.ptr)
        assert info is not None
        assert info.allowed_handle_types & _declarations.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


@pytest.mark.gpu
def test_managed_memory_is_not_legacy_ipc_capable(cupy: Any, cuda_device: int) -> None:
    """Managed memory reports is_managed and cannot go through a legacy handle (CopyRequiredError)."""
    memory = cupy.cuda.malloc_managed(1 << 20)
    info = cuda.pointer_info(memory.ptr)
    assert info is not None
    assert info.is_managed
    assert info.memory_type == "managed"
    assert not info.legacy_ipc_capable
    with pytest.raises(CopyRequiredError):
        cuda.LegacyHandleCache().get_for_pointer(memory.ptr)
    del memory


@pytest.mark.gpu
def test_driver_errors_name_the_call(cuda_device: int) -> None:
    """A call the driver refuses raises CudaError with the call, the numeric code and the driver's name."""
    fd = os.open(os.devnull, os.O_RDONLY)  # not a memory pool
    try:
        with pytest.raises(CudaError) as info:
            cuda.import_pool(fd, cuda_device)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    error = info.value
    assert error.call == "cuMemPoolImportFromShareableHandle"
    assert isinstance(error.code, int)
    assert error.code != 0
    assert error.name.startswith("CUDA_ERROR_")
    assert f"cuMemPoolImportFromShareableHandle failed: {error.name} ({error.code})" in str(error)


@pytest.mark.gpu
def test_garbage_handles_raise_cuda_error_and_never_crash(cuda_device: int) -> None:
    """Opening garbage legacy handles raises CudaError; garbage event handles do not crash the process."""
    with _Child(_child_garbage_handles, cuda.device_uuid(cuda_device)) as child:
        outcomes = child.result()
    for label, outcome, detail in outcomes:
        if label.startswith("mem/"):
            assert outcome == "CudaError", (label, outcome, detail)
            assert detail[0] == "cuIpcOpenMemHandle_v2"


@pytest.mark.gpu
def test_threads_share_contexts_and_caches(cupy: Any, cuda_device: int) -> None:
    """Many threads using contexts, pointer_info and the event pool at once leave no context behind."""
    array = cupy.zeros(1 << 16, dtype=cupy.uint8)
    ptr = array.data.ptr
    events = cuda.EventPool(cuda_device)
    barrier = threading.Barrier(8)

    def work(_: int) -> int:
        barrier.wait(timeout=CHILD_TIMEOUT)
        for _ in range(200):
            with cuda.device_context(cuda_device):
                info = cuda.pointer_info(ptr)
                assert info is not None
                assert info.base <= ptr
            event = events.acquire()
            event.record(0)
            events.release(event)
        return cuda_helpers.current_context()

    with ThreadPoolExecutor(8) as pool:
        leftovers = list(pool.map(work, range(8), timeout=CHILD_TIMEOUT))
    assert leftovers == [0] * 8
    assert events.created <= 8
    events.close()
