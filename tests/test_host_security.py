"""What a consumer can and cannot do with the host-memory fds it receives (docs/security.md).

Each attack runs in a separate consumer process that is given only the exported fds, as a consumer
on the other end of the socket would be. The cross-uid variants drop the child to an unprivileged uid
first; they need root to do so and skip otherwise.
"""

from __future__ import annotations

import contextlib
import gc
import json
import mmap
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib
from arrow_ipc_bridge import transport
from arrow_ipc_bridge.errors import RegionError
from arrow_ipc_bridge.host import SharedHostBuffer, allocate_shared, export_host_buffers, shared_alloc
from arrow_ipc_bridge.transport import protocol

PAGE = mmap.PAGESIZE
UNPRIVILEGED_UID = 65534  # "nobody" on most distributions; only its lack of privilege matters

# The consumer: optionally become another uid, then try every way to change the file behind the
# received read-only fd. Prints {attack: "ok" | errno name}.
ATTACKER = r"""
import ctypes, errno, json, mmap, os, sys
fd, uid, offset, attacks = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
PAGE = mmap.PAGESIZE
results = {}

def attempt(name, action):
    if name not in attacks:
        return
    try:
        action()
    except OSError as exc:
        results[name] = errno.errorcode.get(exc.errno, str(exc.errno))
    else:
        results[name] = "ok"

def check(ret):
    if ret == -1 or ret == ctypes.c_void_p(-1).value or ret is None:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return ret

page_offset, in_page = offset // PAGE * PAGE, offset % PAGE

def writable_mapping(target):
    with mmap.mmap(target, PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                   offset=page_offset) as m:
        m[in_page:in_page + 8] = b"MAPWRITE"

def read_only_mapping_made_writable(target):
    address = check(libc.mmap(None, PAGE, mmap.PROT_READ, mmap.MAP_SHARED, target, page_offset))
    check(libc.mprotect(address, PAGE, mmap.PROT_READ | mmap.PROT_WRITE))
    ctypes.memmove(address + in_page, b"PROTECT!", 8)

attempt("mmap_write_received_fd", lambda: writable_mapping(fd))
try:
    rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
except OSError as exc:
    results["reopen_rdwr"] = errno.errorcode.get(exc.errno, str(exc.errno))
else:
    results["reopen_rdwr"] = "ok"
    attempt("pwrite", lambda: os.pwrite(rw, b"PWRITTEN", offset))
    attempt("mmap_write", lambda: writable_mapping(rw))
    attempt("mprotect_write", lambda: read_only_mapping_made_writable(rw))
    attempt("punch_hole", lambda: check(libc.fallocate(rw, 3, page_offset, PAGE)))  # PUNCH_HOLE | KEEP_SIZE
    attempt("truncate", lambda: os.ftruncate(rw, 0))
print(json.dumps(results))
"""

WRITES = ("mmap_write_received_fd", "pwrite", "mmap_write", "mprotect_write", "punch_hole", "truncate")


def run_attacker(
    fd: int, uid: int | None, *, offset: int = 0, attacks: tuple[str, ...] = WRITES
) -> dict[str, str]:
    """Run the consumer process on ``fd`` (as ``uid``, or as this process's uid): it tries ``attacks``,
    writing at file ``offset``, and reports each one's outcome ("ok" or the errno's name)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            ATTACKER,
            str(fd),
            str(-1 if uid is None else uid),
            str(offset),
            ",".join(attacks),
        ],
        pass_fds=[fd],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results: dict[str, str] = json.loads(proc.stdout)
    return results


def require_uid_switch(uid: int | None) -> None:
    if uid is not None and os.geteuid() != 0:
        pytest.skip("switching the consumer to another uid needs root (os.setuid)")


consumers = pytest.mark.parametrize("uid", [None, UNPRIVILEGED_UID], ids=["same-uid", "other-uid"])


@pytest.fixture
def shared_array() -> Iterator[tuple[SharedHostBuffer, pa.Array]]:
    """An int64 array built in allocate_shared memory (the zero-copy case a publisher serves)."""
    n = 4 * PAGE // 8
    with allocate_shared(n * 8, name="aib-test-secure") as shared:
        view = shared.view().cast("q")
        for i in range(n):
            view[i] = i
        view.release()
        yield shared, pa.Array.from_buffers(pa.int64(), n, [None, shared.as_pyarrow()])


# --- allocate_shared: no consumer can write the producer's memory -------------------------------------------
@consumers
def test_consumer_cannot_write_shared_memory(
    shared_array: tuple[SharedHostBuffer, pa.Array], uid: int | None
) -> None:
    """A consumer (same uid or an admitted other uid) given an allocate_shared region fd cannot change it:
    reopening /proc/self/fd/N read-write succeeds (memfd inodes are mode 0777), but every write through it
    fails (F_SEAL_FUTURE_WRITE), as does a writable mapping of the received fd; the data stays unchanged."""
    require_uid_switch(uid)
    shared, arr = shared_array
    before = arr.buffers()[1].to_pybytes()
    with aib.export(arr, copy="never") as exported:
        assert exported.stats.copied_bytes == 0
        (fd,) = exported.fds
        results = run_attacker(fd, uid)
    assert results["reopen_rdwr"] == "ok", results  # the seals, not the file mode, are the protection
    assert {attack: results[attack] for attack in WRITES if results[attack] == "ok"} == {}, results
    assert results["pwrite"] == "EPERM"
    assert results["mmap_write"] == "EPERM"
    assert arr.buffers()[1].to_pybytes() == before
    # The producer still writes its own memory through its mapping.
    shared.view()[:8] = b"PRODUCER"
    assert arr.buffers()[1].to_pybytes()[:8] == b"PRODUCER"


@consumers
def test_publisher_consumer_cannot_write_shared_memory(
    shared_array: tuple[SharedHostBuffer, pa.Array], uid: int | None, tmp_path: Path
) -> None:
    """The same through a Publisher: a raw client gets the ITEM frame's fd, hands it to a consumer process
    (the other-uid case stands for a uid admitted with allowed_uids), and its writes are all refused."""
    _, arr = shared_array
    require_uid_switch(uid)
    before = arr.buffers()[1].to_pybytes()
    with aib.Publisher(tmp_path / "pub.sock", copy="never") as publisher:
        publisher.publish("secure", arr)
        with contextlib.closing(transport.connect(publisher.path)) as conn:
            conn.send(protocol.HELLO, protocol.encode_hello())
            assert conn.recv(timeout=10).kind == protocol.WELCOME
            conn.send(protocol.GET, protocol.encode_name("secure"))
            with conn.recv(timeout=10) as item:
                assert item.kind == protocol.ITEM
                (fd,) = item.fds
                results = run_attacker(fd, uid)
    assert {attack: results[attack] for attack in WRITES if results[attack] == "ok"} == {}, results
    assert arr.buffers()[1].to_pybytes() == before


def test_producer_fd_refuses_new_writes(shared_array: tuple[SharedHostBuffer, pa.Array]) -> None:
    """The seal holds against the producer's fd too: write() and new writable mappings fail; the producer
    writes through view() / as_pyarrow(), the one writable mapping made at allocation."""
    shared, _ = shared_array
    with pytest.raises(PermissionError):
        os.pwrite(shared.fd, b"x", 0)
    with pytest.raises(PermissionError):
        mmap.mmap(shared.fd, PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with mmap.mmap(shared.fd, PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:  # reading is fine
        assert m[:8] == (0).to_bytes(8, "little")


# --- allocate_shared: the whole allocation is readable ------------------------------------------------------
def test_region_fd_exposes_the_whole_allocation_unless_copied() -> None:
    """Publishing part of an allocation hands out its whole memfd: a consumer can read bytes that were never
    published (documented). copy="always" sends a sealed copy of the published bytes alone."""
    secret = b"never-published"
    with allocate_shared(1 << 20) as shared:
        view = shared.view()
        view[:8000] = b"p" * 8000
        view[512 * 1024 : 512 * 1024 + len(secret)] = secret
        view.release()
        published = (shared.address, 8000)
        with export_host_buffers([published], copy="never") as export:
            (region,) = export.regions
            assert region.zero_copy
            assert region.size == 8000  # what the consumer is told to map...
            assert os.fstat(region.fd).st_size == 1 << 20  # ...but the fd is the whole file
            assert os.pread(region.fd, len(secret), 512 * 1024) == secret
        with export_host_buffers([published], copy="always") as export:
            (region,) = export.regions
            assert not region.zero_copy
            assert region.sealed
            assert os.fstat(region.fd).st_size == 8000  # 8000 is a multiple of the 64-byte alignment
            assert os.pread(region.fd, 8000, 0) == b"p" * 8000


# --- zero-copy files: protected only by their permissions ---------------------------------------------------
@contextlib.contextmanager
def mapped_shm_table(mode: int) -> Iterator[pa.Table]:
    """An Arrow IPC file under /dev/shm with ``mode``, memory-mapped by the producer (pa.memory_map)."""
    table = pa.table({"x": pa.array(range(4 * PAGE), pa.int64())})
    with tempfile.NamedTemporaryFile(
        dir="/dev/shm", prefix="aib-test-perm-", suffix=".arrow", delete=False
    ) as f:
        path = f.name
    try:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        os.chmod(path, mode)
        with pa.memory_map(path) as source:
            yield pa.ipc.open_file(source).read_all()
    finally:
        os.unlink(path)


@consumers
def test_zero_copy_file_is_as_writable_as_its_mode(uid: int | None) -> None:
    """A zero-copy region over a producer's file is protected only by the file's permissions: with mode
    0644 a consumer of the file's uid can reopen it read-write and change what the producer (and every
    other consumer) reads; a consumer of another uid cannot reopen it for writing (documented)."""
    require_uid_switch(uid)
    with mapped_shm_table(0o644) as table:
        data = table.column(0).chunk(0).buffers()[1]
        before = data.to_pybytes()
        with export_host_buffers([(data.address, data.size)], copy="never") as export:
            (region,) = export.regions
            placement = export.placements[0]
            assert region.zero_copy
            assert placement is not None
            # Truncation would SIGBUS this process through its mapping: only writes are tried.
            results = run_attacker(
                region.fd, uid, offset=region.file_offset + placement.offset, attacks=("pwrite", "mmap_write")
            )
        after = data.to_pybytes()
    if uid is None:
        assert results == {"reopen_rdwr": "ok", "pwrite": "ok", "mmap_write": "ok"}
        assert after[:8] == b"MAPWRITE"  # the producer's own (private, read-only) mapping sees the write
        assert after[8:] == before[8:]
    else:
        assert results == {"reopen_rdwr": "EACCES"}
        assert after == before


def test_kernel_without_future_write_seal_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel refuses the seal (EINVAL, as before Linux 5.1), allocate_shared raises RegionError
    naming the copy policy as the way out, and leaks no fd, mapping or registry entry."""
    # A seal bit no kernel knows makes this kernel answer EINVAL exactly as an old one answers the write seal.
    monkeypatch.setattr(shared_alloc, "_SHARED_SEALS", shared_alloc._SHARED_SEALS | 0x4000)
    gc.collect()
    fds_before = len(os.listdir("/proc/self/fd"))
    registered_before = len(shared_alloc._registry)
    with pytest.raises(RegionError, match="F_SEAL_FUTURE_WRITE") as info:
        allocate_shared(PAGE, name="aib-test-unsealable")
    assert "copy='if_needed'" in str(info.value)
    with open("/proc/self/maps") as maps:
        assert "aib-test-unsealable" not in maps.read()
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert len(shared_alloc._registry) == registered_before
