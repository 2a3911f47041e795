"""Delivers "this owner died" notices from the C core to Python callbacks.

Release callbacks run on any thread, often without the GIL (cuDF releases from C++ threads). They
must not call into Python: taking the GIL from a foreign thread during interpreter shutdown can
deadlock or crash, and a Python callback could raise where nobody can catch it. So the core only
queues the dead owner's token and writes a byte to a pipe; one daemon thread here sleeps on that pipe,
drains the queue and runs the callback registered for each token (a lease release message, a CUDA
handle close). ``drain()`` runs the same work synchronously, for tests and shutdown.

At interpreter exit (``atexit``, before finalization) the thread is stopped: the batch it is
delivering is waited for, it takes no more, and what is still queued runs on the exiting thread. A
callback must not be running on it once finalization starts: closing an export record releases the
producer's buffers, and pyarrow's NumPy-backed or foreign buffers take the GIL in their C++
destructor. A daemon thread that takes the GIL during finalization is ended by ``pthread_exit``,
whose unwinding through that destructor (implicitly ``noexcept``) calls ``std::terminate``: the
process aborted with "terminate called without an active exception" when it exited just after a
``Publisher`` closed, while this thread was still releasing what the close let go.

A child of ``fork`` starts with nothing registered: the owners it inherited belong to the parent's
leases and handles, so their deaths run nothing there (a release would be a frame on the parent's
connection); it registers its own from then on.

A *family* serves many owners with one registration: its tokens are ``base | value`` and the
callback gets ``value``. A session's leases are one family (the value is the lease id), so the C core
can name a lease's owner without a Python call per get.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import select
import threading
from collections.abc import Callable

from arrow_ipc_bridge._ffi import ffi, lib

__all__ = [
    "FAMILY_VALUE_BITS",
    "register",
    "register_family",
    "unregister",
    "unregister_family",
    "drain",
    "settle",
    "pending_callbacks",
]

_log = logging.getLogger("arrow_ipc_bridge")
_lock = threading.Lock()
_callbacks: dict[int, Callable[[], None]] = {}
_tokens = itertools.count(1)
_thread: threading.Thread | None = None
_BATCH = 256
_buffers = threading.local()
FAMILY_VALUE_BITS = int(lib.AIB_LEASE_ID_BITS)  # the C core puts lease ids in the low bits
_VALUE_MASK = (1 << FAMILY_VALUE_BITS) - 1
_families: dict[int, Callable[[int], None]] = {}
_family_ids = itertools.count(1)
# Held by the reaper thread while it drains: a thread that must see every notice already queued run
# (settle) waits on it for the batch the reaper thread may have taken out of the queue before it.
_delivering = threading.Lock()
# Set at interpreter exit (under _delivering): the reaper thread delivers nothing more.
_stopped = False
# How long exit waits for a notice being delivered: longer than any callback takes (a RELEASE send
# or an export close), and bounded so that a callback stuck on a dead peer cannot hang the exit.
_EXIT_WAIT_S = 10.0


def register(callback: Callable[[], None]) -> int:
    """Return a fresh token whose owner's death runs ``callback`` on the reaper thread."""
    _ensure_thread()
    token = next(_tokens)
    with _lock:
        _callbacks[token] = callback
    return token


def register_family(callback: Callable[[int], None]) -> int:
    """Return a token base: an owner dying with token ``base | value`` (0 < value <
    2**FAMILY_VALUE_BITS) runs ``callback(value)`` on the reaper thread, until unregistered."""
    _ensure_thread()
    family = next(_family_ids)
    if family >= 1 << (64 - FAMILY_VALUE_BITS):
        raise RuntimeError("out of reaper token families")
    with _lock:
        _families[family] = callback
    return family << FAMILY_VALUE_BITS


def unregister_family(base: int) -> None:
    """Forget a family: owners of it that die later run nothing."""
    with _lock:
        _families.pop(base >> FAMILY_VALUE_BITS, None)


def unregister(token: int) -> bool:
    """Forget ``token``'s callback without running it; False when it already ran (or is running)."""
    with _lock:
        return _callbacks.pop(token, None) is not None


def pending_callbacks() -> int:
    """How many registered owners are still alive (for leak tests)."""
    with _lock:
        return len(_callbacks)


def drain() -> int:
    """Run the callbacks of every owner that died so far; return how many ran."""
    try:
        out = _buffers.out
    except AttributeError:  # one per thread: drain runs on the reaper thread and on releasing threads
        out = _buffers.out = ffi.new("uint64_t[]", _BATCH)
    ran = 0
    while True:
        n = lib.aib_reaper_drain(out, _BATCH)
        if n == 0:
            return ran
        # Copied out (ffi.unpack makes a list) before any callback runs: a callback may drain again
        # on this thread, into the same buffer. The registries are read without the lock: a dict's
        # get and pop are atomic, and a family unregistered meanwhile runs its last notice.
        for token in ffi.unpack(out, n):
            family = token >> FAMILY_VALUE_BITS
            try:
                if family:
                    member = _families.get(family)
                    if member is None:
                        continue
                    member(token & _VALUE_MASK)
                else:
                    callback = _callbacks.pop(token, None)
                    if callback is None:
                        continue
                    callback()
                ran += 1
            except Exception:  # a failing notice must not stop the others
                ran += 1
                _log.exception("arrow_ipc_bridge: owner release callback failed")
        # Not done on a short batch: a callback above may have let an owner die on this thread,
        # and when this thread is quiet (aib_reaper_quiet: a publish, a release) that death was
        # queued without waking the reaper thread. Only an empty queue ends the drain.


def settle(timeout: float = 1.0) -> None:
    """Return once the callback of every owner that died before this call has run: those still
    queued run on this thread (:func:`drain`), and one the reaper thread already took out of the
    queue is waited for (at most ``timeout`` seconds; never on the reaper thread itself). For a
    close that must act after its objects' release notices (a live stream giving its credit back
    before its connection ends)."""
    drain()
    thread = _thread
    if thread is None or thread is threading.current_thread():
        return
    if _delivering.acquire(timeout=timeout):
        _delivering.release()


def _after_fork_in_child() -> None:
    # The parent's owners' callbacks act on the parent's resources (a lease release is a frame on
    # the parent's connection): none runs here. The C core empties its queue and makes its own
    # pipe (owner.c); the thread, if any, stayed in the parent; the locks may have been held.
    global _lock, _thread, _delivering
    _lock = threading.Lock()
    _delivering = threading.Lock()
    _thread = None
    _callbacks.clear()
    _families.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _run() -> None:
    # poll, not select: select refuses descriptors >= FD_SETSIZE (1024), and a process holding many
    # descriptors when the reaper starts gets a reaper fd above that.
    poller = select.poll()
    poller.register(lib.aib_reaper_fd(), select.POLLIN)
    while True:
        poller.poll()
        with _delivering:
            if _stopped:
                return
            drain()


def _stop_at_exit() -> None:
    """Stop the reaper thread before the interpreter finalizes, and run what is queued here."""
    global _stopped
    waited = _delivering.acquire(timeout=_EXIT_WAIT_S)
    _stopped = True
    if waited:
        _delivering.release()
    else:
        _log.warning("arrow_ipc_bridge: an owner release callback still runs at exit")
    if _thread is not threading.current_thread():
        drain()


atexit.register(_stop_at_exit)


def _ensure_thread() -> None:
    global _thread
    if _thread is not None:
        return
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="arrow_ipc_bridge-reaper", daemon=True)
            _thread.start()
