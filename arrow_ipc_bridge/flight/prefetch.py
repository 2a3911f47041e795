"""A worker thread that prepares the next items of an iterator while the consumer handles the current one.

The front sends a live stream through a :class:`Prefetcher`: its worker takes the stream's next
batch and stages it (a GPU batch) or builds its record batches (a host batch) one item ahead of
gRPC, so the copy of the next chunk overlaps the send of the current one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")
R = TypeVar("R")

_DONE = object()


class Prefetcher(Generic[T, R]):
    """Iterates ``convert(item)`` for each item of ``source``, converting up to ``depth`` items ahead
    on a thread of its own. An exception of ``source`` or ``convert`` is raised by ``__next__`` in
    order. ``close()`` (also when the consumer stops iterating early) stops the thread; items taken
    but not handed out are given to ``discard``."""

    def __init__(
        self,
        source: Iterator[T],
        convert: Callable[[T], R],
        *,
        depth: int = 1,
        discard: Callable[[R], None] | None = None,
        name: str = "aib-flight-staging",
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self._source = source
        self._convert = convert
        self._discard = discard
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless stopped meanwhile (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        outcome: object
        try:
            outcome = self._pump()
        except BaseException as exc:  # handed to the consumer, in order
            outcome = exc
        # A generator source ends here, on this thread (it cannot be closed from another while it
        # runs): its own cleanup (staging buffers, imports taken) runs now, not at its collection.
        close = getattr(self._source, "close", None)
        try:
            if close is not None:
                close()
        except BaseException as exc:
            outcome = exc if outcome is _DONE else outcome
        if outcome is not None:
            self._put(outcome)

    def _pump(self) -> object:
        """Convert and queue every item: ``_DONE`` at the source's end, None when stopped."""
        for item in self._source:
            if self._stop.is_set():
                return None
            converted = self._convert(item)
            # Dropped as soon as queued: a reference kept here while the next item is awaited
            # would hold what was handed out (a staging buffer, a lease) after gRPC dropped it.
            del item
            if not self._put(converted):
                if self._discard is not None:
                    self._discard(converted)
                return None
            del converted
        return _DONE

    def __iter__(self) -> Prefetcher[T, R]:
        return self

    def __next__(self) -> R:
        while True:
            if self._stop.is_set():
                raise StopIteration
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise StopIteration from None
                continue
            if item is _DONE:
                raise StopIteration
            if isinstance(item, BaseException):
                raise item
            return item  # type: ignore[return-value]

    def close(self, timeout: float = 5.0) -> None:
        """Stop converting; drop what was converted but not handed out (idempotent)."""
        self._stop.set()
        self._thread.join(timeout)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if self._discard is not None and item is not _DONE and not isinstance(item, BaseException):
                self._discard(item)  # type: ignore[arg-type]
