"""Device data made host record batches for gRPC, the copy of the next batch overlapping the send
of the current one.

gRPC sends host memory only. A publication on a GPU is copied to the host once per ``do_get``
(``imported.to_host``: one device-to-host copy per region, after the producer's event) and then
streamed; a live stream on a GPU is copied batch by batch on a worker thread that stays one batch
ahead of the sender (:class:`Prefetcher`), so the copy of batch n+1 runs while gRPC sends batch n.
The worker holds at most ``depth`` converted batches, so memory stays bounded by the consumer's
pace (a slow client stops the sender, which stops the worker, which stops giving credit back).
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
        try:
            for item in self._source:
                if self._stop.is_set():
                    return
                converted = self._convert(item)
                if not self._put(converted):
                    if self._discard is not None:
                        self._discard(converted)
                    return
        except BaseException as exc:  # handed to the consumer, in order
            self._put(exc)
            return
        self._put(_DONE)

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
