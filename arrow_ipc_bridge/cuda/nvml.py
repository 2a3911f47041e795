"""How two GPUs are wired (NVLink, or which PCIe path), from NVML when the driver ships it.

The CUDA driver says whether a pair has a peer path and ranks it, not what it is; NVML
(``libnvidia-ml.so.1``, installed with the driver) does. It is optional: without it, or when it
refuses, every answer is ``"unknown"`` and nothing fails. Opened with ``dlopen`` on first use
through cffi's ABI mode, as ``_driver.py`` opens ``libcuda`` (a diagnostic's few calls; nothing is
compiled against it), initialised once per process and never
shut down (other libraries in the process may use it too, and ``nvmlInit`` is reference counted).
GPUs are named by UUID (``GPU-...``), the identity CUDA and NVML share whatever
``CUDA_VISIBLE_DEVICES`` says.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import cffi

__all__ = ["gpu_link", "nvml_available"]

_LIBRARY: Final = "libnvidia-ml.so.1"
_SUCCESS: Final = 0
_P2P_CAPS_INDEX_NVLINK: Final = 2  # nvmlGpuP2PCapsIndex_t
_P2P_STATUS_OK: Final = 0  # nvmlGpuP2PStatus_t
_NVLINK_MAX_LINKS: Final = 18  # NVML_NVLINK_MAX_LINKS (Hopper has 18)
_FEATURE_ENABLED: Final = 1
# nvmlGpuTopologyLevel_t: the closest common ancestor of two GPUs on the PCIe tree, as nvidia-smi
# topo -m spells it
_TOPOLOGY_LEVELS: Final[dict[int, str]] = {
    0: "same board",
    10: "PCIe switch (PIX)",
    20: "PCIe switches (PXB)",
    30: "PCIe host bridge (PHB)",
    40: "NUMA node (NODE)",
    50: "across NUMA nodes (SYS)",
}

# The few NVML entry points used here (nvml.h; handles are opaque pointers, enums ints).
_DECLARATIONS: Final = """
typedef struct nvmlDevice_st *nvmlDevice_t;
int nvmlInit_v2(void);
int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device);
int nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive);
int nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, int p2pIndex, int *p2pStatus);
int nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2, int *pathInfo);
"""

_ffi = cffi.FFI()
_ffi.cdef(_DECLARATIONS)
_lock = threading.Lock()
_state: dict[str, Any] = {"lib": None, "failure": None}


def _load() -> Any:
    """The initialised library, or None (the reason kept in ``_state['failure']``)."""
    with _lock:
        if _state["lib"] is not None or _state["failure"] is not None:
            return _state["lib"]
        try:
            lib = _ffi.dlopen(_LIBRARY)
            rc = lib.nvmlInit_v2()
        except (OSError, AttributeError) as exc:
            _state["failure"] = f"{_LIBRARY} not usable: {exc}"
            return None
        if rc != _SUCCESS:
            _state["failure"] = f"nvmlInit_v2 returned {rc}"
            return None
        _state["lib"] = lib
        return lib


def nvml_available() -> bool:
    """Whether NVML loaded and initialised in this process (the answer is kept)."""
    return _load() is not None


def _handle(lib: Any, uuid: str) -> Any:
    handle = _ffi.new("nvmlDevice_t *")
    if lib.nvmlDeviceGetHandleByUUID(uuid.encode("ascii"), handle) != _SUCCESS:
        return None
    return handle[0]


def _active_links(lib: Any, handle: Any) -> int:
    active = 0
    state = _ffi.new("int *")
    for link in range(_NVLINK_MAX_LINKS):
        if lib.nvmlDeviceGetNvLinkState(handle, link, state) != _SUCCESS:
            continue  # no such link on this GPU (or NVLink not supported at all)
        active += state[0] == _FEATURE_ENABLED
    return active


def gpu_link(uuid_a: str, uuid_b: str) -> str:
    """How GPUs ``uuid_a`` and ``uuid_b`` (``GPU-...`` strings) are wired, in words.

    ``"NVLink (N active links on the first GPU)"`` when NVML reports an NVLink peer path between them,
    ``"PCIe via <common ancestor>"`` otherwise, ``"unknown (<why>)"`` when NVML is missing or
    does not know the GPUs.
    """
    lib = _load()
    if lib is None:
        return f"unknown ({_state['failure']})"
    a, b = _handle(lib, uuid_a), _handle(lib, uuid_b)
    if a is None or b is None:
        return "unknown (NVML does not know these GPUs)"
    status = _ffi.new("int *")
    rc = lib.nvmlDeviceGetP2PStatus(a, b, _P2P_CAPS_INDEX_NVLINK, status)
    if rc == _SUCCESS and status[0] == _P2P_STATUS_OK:
        return f"NVLink ({_active_links(lib, a)} active links on the first GPU)"
    level = _ffi.new("int *")
    if lib.nvmlDeviceGetTopologyCommonAncestor(a, b, level) != _SUCCESS:
        return "PCIe (path unknown)" if rc == _SUCCESS else "unknown (NVML gave no link status)"
    return f"PCIe via {_TOPOLOGY_LEVELS.get(level[0], f'topology level {level[0]}')}"
