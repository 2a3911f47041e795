"""The session counters of ``aib.stats()`` since a point in a test: what a test that reads how its
session imported (remembered, local, new-message gets, reused CuPy arrays) checks, now that the
counters live only in ``aib.stats().session`` (process-wide)."""

from __future__ import annotations

import arrow_ipc_bridge as aib


class SessionCounts:
    """``aib.stats().session`` less its value when this was made (or last :meth:`reset`): the gets
    of the sessions this process ran since, which in a test is the one session it checks."""

    def __init__(self) -> None:
        self._start = aib.stats().session

    def reset(self) -> None:
        self._start = aib.stats().session

    def _delta(self, field: str) -> int:
        return int(getattr(aib.stats().session, field) - getattr(self._start, field))

    @property
    def remembered_gets(self) -> int:
        return self._delta("remembered_gets")

    @property
    def local_gets(self) -> int:
        return self._delta("local_gets")

    @property
    def new_message_gets(self) -> int:
        return self._delta("new_message_gets")

    @property
    def reused_cupy_arrays(self) -> int:
        return self._delta("reused_cupy_arrays")
