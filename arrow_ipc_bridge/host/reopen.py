"""Reopening the file behind a mapping read-only (the fd a zero-copy region sends), or why it cannot be.

A zero-copy region never sends the producer's own file description: it sends a fresh read-only open of the
file, verified (device and inode) to be the file that is mapped.
"""

from __future__ import annotations

import os
import stat
from typing import Final

from arrow_ipc_bridge.host import shared_alloc
from arrow_ipc_bridge.host.counters import _count
from arrow_ipc_bridge.host.proc_maps import SharedMapping, _lookup, _not_shareable
from arrow_ipc_bridge.runtime.file_limit import is_out_of_descriptors

# O_NONBLOCK: if a path in the maps was replaced by a FIFO, opening it must not hang (files ignore it).
_RDONLY: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_DELETED: Final = " (deleted)"
_map_files_open_ok = True  # cleared on the first EPERM (opening map_files needs CAP_SYS_ADMIN)


def _explain_not_shareable(address: int, nbytes: int) -> str:
    mapping = _lookup(address, nbytes, insist=True)
    reason = _not_shareable(mapping, address, nbytes)
    if reason is not None:
        return reason
    assert mapping is not None
    if mapping.source != "registry" and mapping.path.endswith(_DELETED) and not _map_files_open_ok:
        return (
            f"its file {mapping.path!r} is deleted or a memfd, /proc/self/map_files refused to open it "
            "(needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE) and no open fd of this process refers to it"
        )
    name = mapping.path or "(memfd)"
    return f"its file {name!r} could not be reopened read-only, or is shorter than the mapping"


def _open_verified(path: str, mapping: SharedMapping) -> int | None:
    """Open ``path`` read-only; keep the fd only if it is the mapping's regular file (device and inode).

    Raises PermissionError (the caller decides what a refusal means) and running out of descriptors
    (EMFILE, ENFILE: copying instead would need one too, and must not hide the cause); other
    failures give None.
    """
    try:
        fd = os.open(path, _RDONLY)
    except PermissionError:
        raise
    except OSError as exc:
        if is_out_of_descriptors(exc):
            raise
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if stat.S_ISREG(st.st_mode) and _same_file(st, mapping):
        return fd
    os.close(fd)
    return None


def _same_file(st: os.stat_result, mapping: SharedMapping) -> bool:
    # The maps show the device of the inode's superblock. On overlayfs and btrfs subvolumes stat() reports
    # another device, so such files do not verify and are copied instead: never share a file not proven same.
    return st.st_ino == mapping.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == (
        mapping.dev_major,
        mapping.dev_minor,
    )


def _open_mapping_file(mapping: SharedMapping) -> int | None:
    """A new read-only fd on the file behind ``mapping`` (a fresh open file description), or None.

    Tried in order: the registry memfd reopened through /proc/self/fd (never hands the owner's O_RDWR
    description to a consumer); the path, if it still names the same inode; /proc/self/map_files/START-END
    (opening it needs CAP_SYS_ADMIN, or CAP_CHECKPOINT_RESTORE since Linux 5.9: refused to ordinary users);
    an fd of this process open on the same inode, reopened through /proc/self/fd (needs no privilege).

    The first three check the file that is mapped *now* (the path resolves to the mapping's inode, the
    map_files link is the mapping itself). The fd-table scan only proves an fd on the inode the lookup
    reported, so it is used only with fresh lookup data, never with a cached line of /proc/self/maps.
    """
    global _map_files_open_ok
    if mapping.source == "registry":
        # Under the lock: the buffer's destructor cannot close its fd (and the kernel reuse the number) from
        # another thread meanwhile; the inode check covers garbage collection in this thread.
        with shared_alloc._registry_lock:
            try:
                return _open_verified(f"/proc/self/fd/{mapping.registry_fd}", mapping)
            except PermissionError:
                return None
    if mapping.path.startswith("/") and not mapping.path.endswith(_DELETED):
        try:
            fd = _open_verified(mapping.path, mapping)
        except PermissionError:
            fd = None  # not readable by us under that name; the fallbacks may still reach it
        if fd is not None:
            return fd
    if _map_files_open_ok:
        try:
            fd = _open_verified(f"/proc/self/map_files/{mapping.start:x}-{mapping.end:x}", mapping)
        except PermissionError:
            _map_files_open_ok = False  # no capability: the same for every later call, skip the syscall
            fd = None
        if fd is not None:
            return fd
    if mapping.source == "proc_maps_cache":
        return None
    return _open_from_fd_table(mapping)


def _open_from_fd_table(mapping: SharedMapping) -> int | None:
    """Reopen, read-only, an fd of this process that is open on the mapping's file (memfds, deleted files)."""
    _count(fd_scans=1)
    try:
        with os.scandir("/proc/self/fd") as entries:
            for entry in entries:
                try:
                    st = os.stat(entry.path)
                except OSError:
                    continue  # closed meanwhile, or the scandir fd itself
                if _same_file(st, mapping):
                    try:
                        fd = _open_verified(entry.path, mapping)
                    except PermissionError:
                        continue
                    if fd is not None:
                        return fd
    except OSError as exc:
        if is_out_of_descriptors(exc):  # the scan's own descriptor: no fd left (see _open_verified)
            raise
        return None
    return None
