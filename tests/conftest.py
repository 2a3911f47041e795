"""Shared test configuration: hypothesis profiles and capability fixtures.

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

import os
import random

import pytest
from hypothesis import HealthCheck, settings

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run only with RUN_SLOW=1 (the long local profile)."""
    if os.environ.get("RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set RUN_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
