"""Reaper families: an owner dying with a family token reaches the family's callback with its value,
and a callback may drain the queue again.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import pytest

from arrow_ipc_bridge._ffi import lib
from arrow_ipc_bridge.runtime import reaper

pytestmark = pytest.mark.usefixtures("no_leaks")


def test_reaper_family_tokens_reach_their_callback_with_the_value() -> None:
    """An owner dying with token base | value runs the family's callback with value; after the family
    is retired, its owners run nothing."""
    seen: list[int] = []
    base = reaper.register_family(seen.append)
    try:
        for value in (1, 12345, (1 << reaper.FAMILY_VALUE_BITS) - 1):
            lib.aib_owner_unref(lib.aib_owner_new(base | value))
        reaper.drain()
        assert seen == [1, 12345, (1 << reaper.FAMILY_VALUE_BITS) - 1]
    finally:
        reaper.unregister_family(base)
    lib.aib_owner_unref(lib.aib_owner_new(base | 5))
    reaper.drain()
    assert seen == [1, 12345, (1 << reaper.FAMILY_VALUE_BITS) - 1]


def test_a_reaper_callback_may_drain_again() -> None:
    """A callback that drains the queue itself (on the same thread) neither loses nor repeats the
    notices of the batch being run."""
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        lib.aib_reaper_quiet(1)  # this thread drains them, not the reaper thread
        try:
            for i in range(3):  # enough to overwrite the rest of a shared batch buffer
                lib.aib_owner_unref(lib.aib_owner_new(reaper.register(lambda i=i: ran.append(f"inner{i}"))))
        finally:
            lib.aib_reaper_quiet(0)
        reaper.drain()

    reaper.drain()  # nothing queued from before
    tokens = [reaper.register(first)] + [
        reaper.register(lambda i=i: ran.append(f"later{i}")) for i in range(3)
    ]
    owners = [lib.aib_owner_new(token) for token in tokens]
    lib.aib_reaper_quiet(1)  # queued here, run by the drain below (not by the reaper thread)
    try:
        for owner in owners:
            lib.aib_owner_unref(owner)
    finally:
        lib.aib_reaper_quiet(0)
    reaper.drain()
    assert sorted(ran) == ["first", "inner0", "inner1", "inner2", "later0", "later1", "later2"]
