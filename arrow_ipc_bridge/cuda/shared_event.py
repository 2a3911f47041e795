"""One pooled interprocess event named by the messages of several versions of a publication.

A producer that updates the same arrays in place and publishes them again each step places every
version in the same regions: only the event's handle would make the messages differ. A publisher
keeps the message bytes then (``producer/exporter.py``, ``previous=``): the new version names the event the
current one named, re-recorded after the producer's new work, so a consumer's get finds the message
it remembers instead of importing a new one.

Why re-recording is sound (``docs/lifetime.md``, "Synchronisation"): every record of a shared event
is made on the legacy default stream, after that stream waited for the producer's event of the new
version, so each record completes only after the work every earlier record covered. A consumer
that waits on the event while it holds an older version waits for the newer record: it may wait
longer than it needed, never less; one that finds the event completed (``cuEventQuery``) knows the
older version's work completed too. The event goes back to the pool when the last export naming
it closed (every version that sent it unpublished or replaced, and every lease on them ended).
"""

from __future__ import annotations

import threading

from arrow_ipc_bridge.cuda.events import Event, EventPool
from arrow_ipc_bridge.cuda.placer import remember_local_event

__all__ = ["SharedEvent"]


class SharedEvent:
    """A pooled event and the exports whose messages name it (a count of references).

    Made with one reference (the export that recorded it first); :meth:`take` adds one for each
    later export that sends it again, :meth:`drop` ends one; the last returns it to ``events``.
    """

    __slots__ = ("_event", "_event_value", "_events", "_lock", "_refs", "device", "handle")

    def __init__(self, events: EventPool, event: Event) -> None:
        self._events = events
        self._event = event
        self._lock = threading.Lock()
        self._refs = 1
        self.device = events.device
        self.handle = event.ipc_handle()  # what the messages carry as their sync handle
        self._event_value = event.handle  # the CUevent, read once (the event never changes)

    @property
    def event(self) -> int:
        """The ``CUevent`` (for a same-process consumer, which cannot open its own handle)."""
        return self._event.handle

    def take(self) -> bool:
        """One more export names the event; False (and no reference) when it went back to the pool."""
        with self._lock:
            if self._refs == 0:
                return False
            self._refs += 1
            return True

    def drop(self) -> None:
        """An export naming the event closed; the last one gives the event back to the pool."""
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self._events.release(self._event)

    def record_after(self, producer_event: int) -> None:
        """Record the event on the legacy default stream after ``producer_event`` (a ``CUevent``;
        0: none), that is after the producer's work on the new version and, the stream being the
        one every record of this event is made on, after every earlier record; then remember it
        for a consumer in this process (``placer.remember_local_event``: CUDA refuses to open an
        IPC event handle in the process that made it). One context check for the wait and the
        record (``Event._record_on_legacy_stream``)."""
        self._event._record_on_legacy_stream(producer_event)
        remember_local_event(self.handle, self._event_value)
