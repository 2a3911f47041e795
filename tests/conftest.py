"""Shared test configuration: hypothesis profiles and capability fixtures.

Also the fixtures of the publisher/session tests (``no_leaks``, ``publisher``, ``producer`` ...; their
parts are in ``helpers.session_rig``).

Profiles: ``ci`` (default, bounded so the suite fits CI on 2 cores) and ``long`` for local runs
(``HYPOTHESIS_PROFILE=long pytest``). GPU tests carry the ``gpu`` marker and take the
``cuda_device`` fixture, which skips with the reason when there is no usable CUDA GPU.

Hypothesis explores new examples on every run (a fixed ``derandomize`` would try the same few
examples forever) and stays reproducible: every run uses one seed for all property tests, printed
in the report header; ``pytest --hypothesis-seed=N`` (or ``HYPOTHESIS_SEED=N``) replays a run, and a
failure also prints a ``@reproduce_failure`` blob. The example database (``.hypothesis/``, ignored
by git) replays local failures first.
"""

from __future__ import annotations

import contextlib
import multiprocessing.resource_tracker
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.transport import Connection
from arrow_ipc_bridge.transport.channel import Channel

if TYPE_CHECKING:
    from helpers.session_rig import ProducerRig

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Pick this run's hypothesis seed unless ``--hypothesis-seed`` gave one: ``HYPOTHESIS_SEED``, else a
    fresh random one. Runs before hypothesis' own plugin reads the option."""
    if config.getoption("hypothesis_seed", default=None) is None:
        seed = os.environ.get("HYPOTHESIS_SEED") or str(random.SystemRandom().randrange(2**32))
        config.option.hypothesis_seed = seed


def _seed_line(config: pytest.Config) -> str:
    seed = config.getoption("hypothesis_seed", default=None)
    return f"hypothesis seed {seed}: replay this run's examples with --hypothesis-seed={seed}"


def pytest_report_header(config: pytest.Config) -> str:
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The seed again at the end, where a CI log is read (``-q`` hides the header)."""
    terminalreporter.write_line(_seed_line(config))


@pytest.fixture(scope="session")
def cuda_device() -> int:
    """The ordinal of a usable CUDA GPU, or a skip that says why there is none."""
    from arrow_ipc_bridge import cuda

    if not cuda.driver_available():
        pytest.skip("no CUDA driver (libcuda.so.1) on this machine")
    if cuda.device_count() == 0:
        pytest.skip("the CUDA driver reports no GPU")
    return 0


def _long_profile() -> bool:
    """A long local run (docs/reliability.md): more kills, examples or rounds than CI's."""
    return (
        os.environ.get("RUN_SLOW") == "1"
        or os.environ.get("AIB_LONG") == "1"
        or os.environ.get("HYPOTHESIS_PROFILE") == "long"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run only with RUN_SLOW=1 (the long local profile). The long profiles
    lift the per-test timeout (pyproject.toml): their runs take many minutes by design."""
    if _long_profile():
        for item in items:
            item.add_marker(pytest.mark.timeout(0))
    if os.environ.get("RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set RUN_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# --- the publisher/session tests' fixtures ------------------------------------------------------------------
# The files that test publishers and sessions (test_round_trips.py, test_leases.py, ...) mark every test with
# ``pytest.mark.usefixtures("no_leaks")``; ``warm`` is module-scoped, so each of those files records its own
# baseline. The helpers are imported inside the fixtures: ``helpers.session_rig`` reads the hypothesis profile
# when it is imported, which must be after the profile above is loaded.


@pytest.fixture(scope="module")
def warm() -> dict[str, int]:
    """Open once what the library and multiprocessing keep open for the life of the process (the reaper's
    pipe and thread, the linger thread, /proc/self/maps and pagemap, the resource tracker's pipe), then
    record the baseline."""
    from helpers.session_rig import FakeKeptLeaseHolder, sample_table, snapshot, write_shm_ipc_file

    from arrow_ipc_bridge.consumer import linger

    multiprocessing.resource_tracker.ensure_running()
    linger.watch(FakeKeptLeaseHolder([]))  # starts the thread (it is collected right away)
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-")
    shm = write_shm_ipc_file(sample_table(100))
    try:
        mapped = pa.ipc.open_file(pa.memory_map(shm)).read_all()
        with aib.Publisher(os.path.join(directory, "w.sock")) as pub:
            pub.publish("heap", sample_table(100))
            pub.publish("mapped", mapped)
            with aib.connect(pub.path, timeout=10.0) as session:
                for name in ("heap", "mapped"):
                    with session.get(name) as imported:
                        assert pa.table(imported).num_rows == 100
        del mapped
    finally:
        os.unlink(shm)
        shutil.rmtree(directory, ignore_errors=True)
    return snapshot()


@pytest.fixture
def no_leaks(warm: dict[str, int]) -> Iterator[None]:
    """After each test (and all its other fixtures' teardown): nothing of it is left behind."""
    from helpers.session_rig import assert_back_to, snapshot

    before = snapshot()
    yield
    assert_back_to(before)


@pytest.fixture
def channels() -> Iterator[tuple[Channel, Channel]]:
    """The channels of two connections over a socketpair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca, cb = Connection(a), Connection(b)
    yield ca.channel, cb.channel
    ca.close()
    cb.close()


@pytest.fixture
def hostile() -> Iterator[tuple[Channel, socket.socket]]:
    """A channel whose peer is a raw socket the test writes arbitrary bytes and descriptors to."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = Connection(a, max_payload=1024 * 1024)
    yield conn.channel, b
    conn.close()
    b.close()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A short directory for socket files (AF_UNIX paths are limited to about 107 bytes), searchable
    by every uid (0o711) for the tests that connect as another uid."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aib-")
    os.chmod(directory, 0o711)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def publisher(sock_dir: str) -> Iterator[aib.Publisher]:
    """A publisher in this process on a socket in ``sock_dir``; it must end with no lease held."""
    pub = aib.Publisher(os.path.join(sock_dir, "pub.sock"))
    yield pub
    pub.close()
    assert pub.active_leases == 0


@pytest.fixture
def producer(sock_dir: str) -> Iterator[ProducerRig]:
    """A producer child (spawn) with its own Publisher, connected to a Publisher in this process."""
    from helpers.session_rig import ProducerChild, ProducerRig

    upstream = aib.Publisher(os.path.join(sock_dir, "up.sock"))
    path = os.path.join(sock_dir, "child.sock")
    child = ProducerChild(path, upstream.path)
    session = None
    try:
        session = aib.connect(path, timeout=10.0)
        yield ProducerRig(child, upstream, path, session)
    finally:
        if session is not None:
            session.close()
        child.stop()
        upstream.close()
        assert upstream.active_leases == 0


@pytest.fixture
def shm_file() -> Iterator[tuple[str, pa.Table]]:
    """A two-batch sample table written as an Arrow IPC file in /dev/shm (memory-mappable): (path, table)."""
    from helpers.session_rig import sample_table, write_shm_ipc_file

    table = sample_table(4000, batches=2)
    path = write_shm_ipc_file(table)
    yield path, table
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
