"""Tests written for Flight mutants of ``tests/mutation/mutants.toml`` that no other test caught
(docs/reliability.md, "Mutation testing"): each names the mutant it kills. Kept apart from
``test_mutation_kills.py`` because they need ``pyarrow.flight`` (skipped without it)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import wait_for

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.runtime import reaper

flight = pytest.importorskip("pyarrow.flight")
from arrow_ipc_bridge.flight import bearer_header, serve  # noqa: E402
from arrow_ipc_bridge.flight.pinned_pool import StagingPool  # noqa: E402
from arrow_ipc_bridge.flight.staging import StagedPublication  # noqa: E402

TOKEN = "t0ken-for-the-tests-only-0123456789"
OTHER = "another-token-of-the-tests-987654"
UNKNOWN = "not-a-token-of-this-server-000000"


# ---------- auth.py: one authorization header ---------------------------------------------------------
@pytest.mark.parametrize(
    "tokens",
    [(TOKEN, UNKNOWN), (UNKNOWN, TOKEN), (TOKEN, OTHER)],
    ids=["known-then-unknown", "unknown-then-known", "two-known"],
)
def test_a_call_with_two_authorization_headers_is_refused(
    publisher: aib.Publisher, tokens: tuple[str, str]
) -> None:
    """Kills ``flight-auth-several-headers``: a call carrying two ``authorization`` headers is
    ambiguous (a proxy in front may judge one, the server the other: a known token beside an
    unknown one must not pass because of the order they come in), so the server refuses it
    whatever they hold; the same client with one header reads the publication."""
    publisher.publish("t", pa.table({"x": [1, 2, 3]}))
    with serve(publisher, tokens=[TOKEN, OTHER]) as front, flight.connect(front.location) as client:
        two = flight.FlightCallOptions(headers=[bearer_header(token) for token in tokens])
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.do_get(flight.Ticket(b"t"), options=two).read_all()
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.list_flights(options=two))
        one = flight.FlightCallOptions(headers=[bearer_header(TOKEN)])
        assert client.do_get(flight.Ticket(b"t"), options=one).read_all().num_rows == 3


# ---------- pinned_pool.py: a buffer lent to a chunk holds the chunk ---------------------------------------
class BoundedCopier:
    """A stand-in device (host buffers, copies by memmove at once) that refuses a copy landing
    outside the buffer it targets, as memory past a pinned buffer would be overwritten by a DMA."""

    def __init__(self) -> None:
        self.buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.outside: list[tuple[int, int]] = []

    def allocate(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(nbytes)
        address = ctypes.addressof(buffer)
        self.buffers[address] = buffer
        return address

    def free(self, address: int) -> None:
        del self.buffers[address]

    def order_after_producer(self, imported: object) -> None:
        pass

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        inside = any(
            start <= dst and dst + nbytes <= start + len(buffer) for start, buffer in self.buffers.items()
        )
        if not inside:
            self.outside.append((dst, nbytes))
            raise AssertionError(f"a copy of {nbytes} bytes at {dst:#x} runs past its staging buffer")
        ctypes.memmove(dst, src, nbytes)

    def fence(self) -> object:
        return None

    def wait(self, fence: object) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def session(publisher: aib.Publisher) -> Iterator[aib.Session]:
    with aib.connect(publisher.path) as s:
        yield s


def _returned(pool: StagingPool) -> bool:
    gc.collect()
    reaper.settle()
    return pool.lent == 0


def test_an_idle_staging_buffer_smaller_than_the_chunk_is_not_lent(
    publisher: aib.Publisher, session: aib.Session
) -> None:
    """Kills ``flight-staging-idle-buffer-too-small``: the pool reuses an idle buffer only when the
    chunk fits in it. A small publication leaves a buffer of ``buffer_bytes`` idle; a batch that
    cannot be sliced (strings) and needs about one and a half of it gets a buffer of its own, and
    every copy stays inside the buffer it was lent (a smaller one would be written past its end:
    another buffer's data, or memory the process does not own)."""
    chunk = 64 << 10
    copier = BoundedCopier()
    pool = StagingPool(copier, buffer_bytes=chunk, max_bytes=16 * chunk)
    publisher.publish("small", pa.table({"x": pa.array(range(1000), pa.int64())}))
    for batch in StagedPublication(session.get("small"), pool, chunk_bytes=chunk):
        assert batch.num_rows == 1000
    del batch
    assert wait_for(lambda: _returned(pool), 5.0)
    assert pool.allocations == 1  # one idle buffer of `chunk` bytes
    strings = pa.table({"s": pa.array([f"row-{i:06d}-" * 9 for i in range(1000)])})  # ~94 KiB, unsliceable
    assert chunk < strings.nbytes < 2 * chunk
    publisher.publish("strings", strings)
    staged = StagedPublication(session.get("strings"), pool, chunk_bytes=chunk)
    got = pa.Table.from_batches(list(staged), schema=staged.schema)
    assert copier.outside == []
    assert_arrays_equal(got, strings)
    assert pool.allocations == 2  # the idle buffer was too small: a new one
    del got, staged
    assert wait_for(lambda: _returned(pool), 5.0)
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    pool.close()
    assert copier.buffers == {}
