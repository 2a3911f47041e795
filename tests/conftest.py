"""Shared test configuration: hypothesis profiles and capability fixtures.

Profiles: ``ci`` (default, bounded so the suite fits CI on 2 cores) and ``long`` for local runs
(``HYPOTHESIS_PROFILE=long pytest``). GPU tests carry the ``gpu`` marker and take the
``cuda_device`` fixture, which skips with the reason when there is no usable CUDA GPU.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "long",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
