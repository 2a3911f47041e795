"""``close()`` that waits for borrowers: the guard between a release and a use on another thread.

Objects that hold a C owner (a decoded message, captured data) are used by C calls that release the
GIL. Without a guard, ``close()`` on another thread during such a call drops the owner under it. A
caller borrows the object around those calls; ``close()`` then marks it closed at once (new
borrows raise :class:`~arrow_ipc_bridge.errors.ClosedError`) and the owner goes when the last
borrower is done.
"""

from __future__ import annotations

import os
import threading

from arrow_ipc_bridge.errors import ClosedError

__all__ = ["DeferredClose"]

# One lock for every object: each use holds it for a few bytecodes.
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a parent thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


class DeferredClose:
    """Mixin: :meth:`borrow` / :meth:`unborrow` around C calls; :meth:`close` defers
    :meth:`_close_now` to the last borrower. ``_closed`` is set before anything is dropped."""

    _closed = False
    _borrowers = 0
    _closed_message = "this object was closed"

    def _close_now(self) -> None:
        """Drop what the object holds (runs once, with no borrower left)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close (idempotent). While another thread has the object borrowed, what it holds goes when
        that thread is done."""
        with _lock:
            if self._closed:
                return
            self._closed = True
            now = self._borrowers == 0
        if now:
            self._close_now()

    def borrow(self) -> None:
        """Keep what the object holds valid until :meth:`unborrow`, even if another thread closes it
        meanwhile. ClosedError when it is closed already."""
        with _lock:
            if self._closed:
                raise ClosedError(self._closed_message, reason="released")
            self._borrowers += 1

    def unborrow(self) -> None:
        """End a :meth:`borrow`; the last one after a close drops what the object holds."""
        with _lock:
            self._borrowers -= 1
            deferred = self._closed and self._borrowers == 0
        if deferred:
            self._close_now()
