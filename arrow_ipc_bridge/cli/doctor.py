"""``doctor``: what this machine supports, each fact a check with what to change when it fails.

Host checks: memfd and its seals (the copied path seals a memfd against writes; ``allocate_shared``
buffers use ``F_SEAL_FUTURE_WRITE``), the kernel, the open-file limit (a publisher holds one fd per
publication), the socket directory, and container hints (namespaces shared with pid 1 or not). CUDA
checks, when a driver and a GPU are present: each handle kind exported by one process and opened by
another (``multiprocessing`` spawn), which is what sharing needs and what a single process cannot tell.
With several GPUs, the topology: for each pair, whether each can read the other's memory in place
(peer access), the link (NVLink or the PCIe path, from NVML when present) and whether data one
process shares on one GPU reaches another process on the other GPU (in place and copied).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import socket
import stat
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from arrow_ipc_bridge.cli._output import print_json

__all__ = ["Check", "PairFacts", "cuda_checks", "doctor", "host_checks", "topology_checks"]

_CHILD_TIMEOUT_S = 60.0  # starting CUDA in a fresh process can take seconds on a busy machine


@dataclass(frozen=True)
class Check:
    """One fact: ``status`` is ``ok``, ``warn`` (works, with a caveat), ``fail`` (sharing that needs
    it will not work) or ``info``; ``advice`` says what to change (empty when nothing)."""

    name: str
    status: str
    detail: str
    advice: str = ""


# ---------- host ----------------------------------------------------------------------------------
def _memfd_checks() -> list[Check]:
    from arrow_ipc_bridge.host import F_SEAL_FUTURE_WRITE

    try:
        fd = os.memfd_create("aib-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as exc:
        return [
            Check("memfd", "fail", f"memfd_create failed: {exc}", "host data needs Linux >= 3.17 with memfd")
        ]
    checks = [Check("memfd", "ok", "memfd_create with MFD_ALLOW_SEALING works")]
    try:
        os.ftruncate(fd, 4096)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
        checks.append(Check("memfd seals", "ok", "F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE accepted"))
    except OSError as exc:
        checks.append(
            Check(
                "memfd seals",
                "fail",
                f"sealing failed: {exc}",
                "copied host data is sealed; use Linux >= 3.17",
            )
        )
    finally:
        os.close(fd)
    try:
        fd = os.memfd_create("aib-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        finally:
            os.close(fd)
        checks.append(
            Check("F_SEAL_FUTURE_WRITE", "ok", "accepted (allocate_shared buffers are read-only to peers)")
        )
    except OSError as exc:
        checks.append(
            Check(
                "F_SEAL_FUTURE_WRITE",
                "warn",
                f"refused: {exc}",
                "allocate_shared needs Linux >= 5.1 to keep peers from writing; other paths work",
            )
        )
    return checks


def _kernel_check() -> Check:
    uname = os.uname()
    return Check("kernel", "info", f"{uname.sysname} {uname.release} ({uname.machine})")


def _fd_limit_check() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    detail = f"RLIMIT_NOFILE soft {soft}, hard {shown_hard}"
    if soft != resource.RLIM_INFINITY and soft < 4096:
        return Check(
            "open-file limit",
            "warn",
            detail,
            "a publisher holds one fd per publication: raise the soft limit (`ulimit -n 65536`, or "
            "resource.setrlimit(RLIMIT_NOFILE, ...) in the producer) up to the hard limit",
        )
    return Check("open-file limit", "ok", detail)


def _socket_dir_check(directory: str) -> Check:
    name = "socket directory"
    try:
        info = os.stat(directory)
    except OSError as exc:
        return Check(name, "fail", f"{directory}: {exc.strerror}", "pick an existing directory for sockets")
    mode = stat.S_IMODE(info.st_mode)
    detail = f"{directory}: mode {mode:o}, owner uid {info.st_uid}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return Check(
            name, "fail", detail + ", not writable here", "put sockets in a directory this user can write"
        )
    path = os.path.join(directory, f"aib-doctor-{os.getpid()}.sock")
    if len(os.fsencode(path)) > 107:
        return Check(
            name, "fail", detail + ", path too long for a Unix socket", "use a shorter directory path"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        return Check(
            name, "fail", f"{detail}, bind failed: {exc.strerror}", "use a directory on a local file system"
        )
    finally:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        return Check(
            name,
            "warn",
            detail + ", world-writable without the sticky bit",
            "anyone may replace a socket here: use a private directory (or Publisher(allowed_uids=...))",
        )
    return Check(name, "ok", detail + ", a socket binds")


def _namespace_checks() -> list[Check]:
    """Compare this process's namespaces with pid 1's: a difference means a container (or a sandbox)."""
    checks = []
    for ns in ("ipc", "pid", "mnt", "net", "user"):
        try:
            ours = os.readlink(f"/proc/self/ns/{ns}")
        except OSError as exc:
            checks.append(Check(f"{ns} namespace", "info", f"unknown: {exc.strerror}"))
            continue
        try:
            init = os.readlink(f"/proc/1/ns/{ns}")
        except OSError as exc:
            checks.append(Check(f"{ns} namespace", "info", f"{ours}; pid 1's not readable ({exc.strerror})"))
            continue
        same = ours == init
        checks.append(
            Check(f"{ns} namespace", "info", f"{ours}, {'same as' if same else 'differs from'} pid 1's")
        )
    hints = [path for path in ("/.dockerenv", "/run/.containerenv") if os.path.exists(path)]
    try:
        with open("/proc/1/cgroup", encoding="utf-8", errors="replace") as f:
            cgroup = f.read()
        hints += [word for word in ("docker", "kubepods", "containerd", "libpod") if word in cgroup]
    except OSError:
        pass
    if hints:
        checks.append(
            Check(
                "container",
                "info",
                f"probably inside a container ({', '.join(hints)})",
                "host data travels as fds over the socket: producer and consumer need the socket (a "
                "shared volume), not --ipc=host; pool and VMM CUDA handles are fds too; legacy CUDA IPC "
                "handles may also need a shared IPC namespace (--ipc=host or --ipc=container:NAME)",
            )
        )
    return checks


def host_checks(socket_dir: str) -> list[Check]:
    """Every host fact (no CUDA)."""
    return [
        _kernel_check(),
        Check("/dev/shm", "info", "present" if os.path.isdir("/dev/shm") else "missing"),
        *_memfd_checks(),
        _fd_limit_check(),
        _socket_dir_check(socket_dir),
        *_namespace_checks(),
    ]


# ---------- CUDA: each handle kind between two processes --------------------------------------------
_KIND_ADVICE = {
    "legacy": "cuIpcGetMemHandle/cuIpcOpenMemHandle failed between processes: both need the same GPU "
    "visible (check CUDA_VISIBLE_DEVICES) and, across containers, a shared IPC namespace; "
    'publish with to_device(allocation="pool") instead',
    "pool": "the IPC memory pool (POSIX fd export) failed: it needs a driver >= 11.2 with memory pools "
    'and POSIX fd handle support; to_device(allocation="legacy") avoids it',
    "vmm": "VMM POSIX fd handles (cuMemExportToShareableHandle) failed: the device must report "
    "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED and both processes the same GPU",
}
_ROWS = 4096


def _handle_kind_producer(kind: str, socket_path: str, conn: Any) -> None:
    """Child process: share CUDA memory of ``kind`` and wait until the parent has opened it."""
    try:
        if kind == "vmm":
            from multiprocessing.reduction import send_handle

            from arrow_ipc_bridge.cuda.vmm import vmm_allocate, vmm_export_fd

            with vmm_allocate(1 << 20, 0) as allocation:
                fd = vmm_export_fd(allocation.ptr, device=0)
                conn.send(("ready", allocation.size))
                send_handle(conn, fd, os.getppid())
                os.close(fd)
                conn.recv()
            return
        import pyarrow as pa

        import arrow_ipc_bridge as aib

        with aib.Publisher(socket_path) as pub:
            pub.publish(
                "doctor",
                aib.to_device(
                    pa.table({"x": pa.array(range(_ROWS), pa.int64())}),
                    allocation="legacy" if kind == "legacy" else "pool",
                ),
            )
            conn.send(("ready", 0))
            conn.recv()
    except BaseException as exc:  # reported to the parent, which prints it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _open_in_this_process(kind: str, socket_path: str, conn: Any, size: int) -> str:
    """Open what the child shared; returns what was seen (raises on failure)."""
    if kind == "vmm":
        from multiprocessing.reduction import recv_handle

        from arrow_ipc_bridge.cuda.vmm import vmm_import

        fd = recv_handle(conn)
        try:
            with vmm_import(fd, size, 0):
                return f"{size} bytes mapped from the other process"
        finally:
            os.close(fd)
    import pyarrow.compute as pc

    import arrow_ipc_bridge as aib

    with aib.connect(socket_path, timeout=_CHILD_TIMEOUT_S) as session, session.get("doctor") as imported:
        host = imported.to_host()
    total = pc.sum(host.column(0)).as_py()
    expected = _ROWS * (_ROWS - 1) // 2
    if total != expected:
        raise RuntimeError(f"read back a sum of {total}, expected {expected}")
    return f"{_ROWS} rows read back correctly"


def _try_handle_kind(kind: str) -> Check:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    with tempfile.TemporaryDirectory(prefix="aib-doctor-") as directory:
        socket_path = os.path.join(directory, "doctor.sock")
        process = context.Process(target=_handle_kind_producer, args=(kind, socket_path, child), daemon=True)
        process.start()
        try:
            if not parent.poll(_CHILD_TIMEOUT_S):
                raise RuntimeError(f"the exporting process did not answer in {_CHILD_TIMEOUT_S:.0f} s")
            state, value = parent.recv()
            if state == "error":
                raise RuntimeError(f"exporting: {value}")
            detail = _open_in_this_process(kind, socket_path, parent, int(value))
            return Check(f"CUDA {kind} handles", "ok", f"between two processes: {detail}")
        except Exception as exc:
            return Check(f"CUDA {kind} handles", "fail", f"between two processes: {exc}", _KIND_ADVICE[kind])
        finally:
            with contextlib.suppress(OSError):
                parent.send("done")
            process.join(_CHILD_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()


# ---------- CUDA: several GPUs ------------------------------------------------------------------------
@dataclass(frozen=True)
class PairFacts:
    """What this process's driver (and NVML) say about two GPUs ``a < b``."""

    a: int
    b: int
    uuid_a: str
    uuid_b: str
    a_reads_b: bool  # cuDeviceCanAccessPeer(a, b)
    b_reads_a: bool
    performance_rank: int | None  # cuDeviceGetP2PAttribute, a reading b; None without access
    native_atomics: bool | None
    link: str  # nvml.gpu_link: "NVLink (...)", "PCIe via ...", "unknown (...)"


def _pair_facts(a: int, b: int) -> PairFacts:
    from arrow_ipc_bridge import cuda
    from arrow_ipc_bridge.cuda import nvml, peer

    uuid_a, uuid_b = cuda.format_uuid(cuda.device_uuid(a)), cuda.format_uuid(cuda.device_uuid(b))
    link = peer.peer_link(a, b)
    return PairFacts(
        a=a,
        b=b,
        uuid_a=uuid_a,
        uuid_b=uuid_b,
        a_reads_b=peer.can_access_peer(a, b),
        b_reads_a=peer.can_access_peer(b, a),
        performance_rank=link.performance_rank if link.access_supported else None,
        native_atomics=link.native_atomics if link.access_supported else None,
        link=nvml.gpu_link(uuid_a, uuid_b),
    )


def topology_checks(count: int, pairs: list[PairFacts]) -> list[Check]:
    """The topology section from the facts: one check per pair of GPUs (``count`` of them).

    Peer access both ways is ``ok``; one way or none is ``warn`` (copies still work, staged by the
    driver, and reading in place fails with ``CudaError`` (``reason="no_peer_access"``))."""
    if count < 2:
        return [Check("GPU topology", "info", "one GPU: no pairs" if count == 1 else "no GPU: no pairs")]
    checks = []
    for pair in pairs:
        name = f"GPU {pair.a} <-> GPU {pair.b}"
        ways = {
            (True, True): "peer access both ways",
            (True, False): f"peer access GPU {pair.a} -> {pair.b} only",
            (False, True): f"peer access GPU {pair.b} -> {pair.a} only",
            (False, False): "no peer access",
        }[(pair.a_reads_b, pair.b_reads_a)]
        facts = [ways, pair.link]
        if pair.performance_rank is not None:
            facts.append(f"performance rank {pair.performance_rank}")
        if pair.native_atomics is not None:
            facts.append("native atomics" if pair.native_atomics else "no native atomics")
        detail = f"{', '.join(facts)} ({pair.uuid_a} / {pair.uuid_b})"
        if pair.a_reads_b and pair.b_reads_a:
            checks.append(Check(name, "ok", detail))
        else:
            checks.append(
                Check(
                    name,
                    "warn",
                    detail,
                    "data from one of these GPUs cannot be read in place on the other (CudaError, "
                    "reason 'no_peer_access'): use imported.to_device(k) or Session(reader_device=k, "
                    "cross_device='copy'), which the driver stages through host memory",
                )
            )
    return checks


def _multi_gpu_producer(socket_path: str, conn: Any, count: int) -> None:
    """Child process: publish a small table on every GPU ("gpu0", "gpu1", ...) until told to stop."""
    try:
        import pyarrow as pa

        import arrow_ipc_bridge as aib

        with aib.Publisher(socket_path) as pub:
            for device in range(count):
                table = pa.table({"x": pa.array(range(_ROWS), pa.int64())})
                pub.publish(f"gpu{device}", aib.to_device(table, device, allocation="legacy"))
            conn.send(("ready", 0))
            conn.recv()
    except BaseException as exc:  # reported to the parent, which prints it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _read_across(session: Any, source: int, reader: int) -> str:
    """Get GPU ``source``'s table, make it readable in place on GPU ``reader`` (when the pair
    allows: peer access, its legacy handle opened there; no kernel reads it, which would need an
    array library) and read a copy on ``reader``; returns what worked (raises when the copy reads
    back wrong)."""
    import pyarrow.compute as pc

    from arrow_ipc_bridge.cuda import peer

    with session.get(f"gpu{source}") as imported:
        if peer.can_access_peer(reader, source):
            readable = imported.readable_on(reader)  # peer access, legacy handles opened there
            if readable is not imported:
                readable.release()
            how = "in place and copied"
        else:
            how = "copied (no peer path: not in place)"
        with imported.to_device(reader) as copy:
            total = pc.sum(copy.to_host().column(0)).as_py()
    expected = _ROWS * (_ROWS - 1) // 2
    if total != expected:
        raise RuntimeError(f"the copy on GPU {reader} reads back a sum of {total}, expected {expected}")
    return how


def _cross_gpu_ipc_checks(count: int) -> list[Check]:
    """One producer process with a table on every GPU; this process reads each on every other GPU."""
    import multiprocessing

    import arrow_ipc_bridge as aib

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    checks = []
    with tempfile.TemporaryDirectory(prefix="aib-doctor-") as directory:
        socket_path = os.path.join(directory, "doctor.sock")
        process = context.Process(target=_multi_gpu_producer, args=(socket_path, child, count), daemon=True)
        process.start()
        try:
            if not parent.poll(_CHILD_TIMEOUT_S):
                raise RuntimeError(f"the exporting process did not answer in {_CHILD_TIMEOUT_S:.0f} s")
            state, value = parent.recv()
            if state == "error":
                raise RuntimeError(f"exporting: {value}")
            with aib.connect(socket_path, timeout=_CHILD_TIMEOUT_S) as session:
                for source in range(count):
                    for reader in range(count):
                        if source == reader:
                            continue
                        name = f"CUDA IPC GPU {source} -> GPU {reader}"
                        try:
                            how = _read_across(session, source, reader)
                            checks.append(Check(name, "ok", f"another process's data on GPU {source} {how}"))
                        except Exception as exc:
                            checks.append(Check(name, "fail", f"{type(exc).__name__}: {exc}", _CROSS_ADVICE))
        except Exception as exc:
            checks.append(Check("CUDA IPC between GPUs", "fail", str(exc), _CROSS_ADVICE))
        finally:
            with contextlib.suppress(OSError):
                parent.send("done")
            process.join(_CHILD_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
    return checks


_CROSS_ADVICE = (
    "both processes must see both GPUs (CUDA_VISIBLE_DEVICES), in any order; across containers the "
    "GPUs and a shared IPC namespace for legacy handles"
)


def gpu_topology_checks(*, between_processes: bool = True) -> list[Check]:
    """The topology section: each pair's facts, and (``between_processes``) the cross-GPU reads."""
    from arrow_ipc_bridge import cuda

    count = cuda.device_count()
    pairs = [_pair_facts(a, b) for a in range(count) for b in range(a + 1, count)]
    checks = topology_checks(count, pairs)
    if count >= 2 and between_processes:
        checks += _cross_gpu_ipc_checks(count)
    return checks


def cuda_checks(*, between_processes: bool = True) -> list[Check]:
    """The driver, each GPU, and (``between_processes``) each handle kind tried between two processes."""
    from arrow_ipc_bridge import cuda

    if not cuda.driver_available():
        return [Check("CUDA", "info", "driver not found (host memory only)")]
    count = cuda.device_count()
    checks = [Check("CUDA", "info", f"driver present, {count} device(s)")]
    for i in range(count):
        checks.append(Check(f"GPU {i}", "info", f"{cuda.device_name(i)} uuid {cuda.device_uuid(i).hex()}"))
    if count == 0:
        return checks
    if between_processes:
        checks += [_try_handle_kind(kind) for kind in ("legacy", "pool", "vmm")]
    checks += gpu_topology_checks(between_processes=between_processes)
    return checks


# ---------- the command ---------------------------------------------------------------------------
def doctor(
    *, socket_dir: str | None = None, cuda_between_processes: bool = True, as_json: bool = False
) -> int:
    """Print the versions and every check; exit 1 when a check failed."""
    import pyarrow as pa

    from arrow_ipc_bridge import __version__
    from arrow_ipc_bridge._ffi import WIRE_VERSION

    checks = host_checks(socket_dir or tempfile.gettempdir()) + cuda_checks(
        between_processes=cuda_between_processes
    )
    versions = {
        "arrow_ipc_bridge": __version__,
        "wire_format": f"{WIRE_VERSION[0]}.{WIRE_VERSION[1]}",
        "pyarrow": pa.__version__,
        "python": sys.version.split()[0],
    }
    failed = any(check.status == "fail" for check in checks)
    if as_json:
        print_json({"versions": versions, "checks": [asdict(check) for check in checks], "ok": not failed})
        return 1 if failed else 0
    print(
        f"arrow_ipc_bridge {versions['arrow_ipc_bridge']}, wire format {versions['wire_format']}, "
        f"pyarrow {versions['pyarrow']}, python {versions['python']}"
    )
    width = max(len(check.name) for check in checks)
    for check in checks:
        print(f"{check.status:4s}  {check.name.ljust(width)}  {check.detail}")
        if check.advice:
            print(f"{'':4s}  {'':{width}s}  -> {check.advice}")
    return 1 if failed else 0


def _gpu_usable() -> bool:
    from arrow_ipc_bridge import cuda

    return cuda.driver_available() and cuda.device_count() > 0
