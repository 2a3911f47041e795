"""The README's two commands install what they run: ``scripts/demo.sh`` the package with its runtime
dependencies only, ``scripts/test.sh`` (through ``scripts/setup-venv.sh``'s default mode) the test
and development tools as well; each slow step says what it does first, and a second run installs
nothing.

The scripts run in a copy of their inputs whose ``.venv/bin/python`` is a stand-in: it records the
pip and demo calls instead of making them (what pip would install is the question, not pip), and
hands ``-c`` snippets to this interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_STAND_IN = """#!/usr/bin/env bash
# Records "-m pip ..." and "-m arrow_ipc_bridge ..." calls; runs "-c" snippets with a real Python.
if [ "$1" = -m ]; then
  echo "$*" >>"{log}"
  exit 0
fi
exec "{python}" "$@"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The scripts and the files their stamps hash, with a stand-in ``.venv/bin/python``."""
    for name in ("scripts/setup-venv.sh", "scripts/demo.sh", "pyproject.toml", "setup.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    (tmp_path / "cffi_build").mkdir()
    (tmp_path / "cffi_build" / "core.c").write_text("/* a C source */\n")
    (tmp_path / "arrow_ipc_bridge").mkdir()
    (tmp_path / "arrow_ipc_bridge" / "_version.py").write_text('__version__ = "0"\n')
    (tmp_path / "arrow_ipc_bridge" / "_bridge_core.abi3.so").write_text("")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(_STAND_IN.format(log=tmp_path / "calls.log", python=sys.executable))
    python.chmod(0o755)
    return tmp_path


def _run(checkout: Path, *command: str) -> tuple[list[str], str]:
    """Run ``command`` in ``checkout``: the stand-in's calls it made, and its stderr."""
    log = checkout / "calls.log"
    log.unlink(missing_ok=True)
    result = subprocess.run(
        ["bash", *command], cwd=checkout, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return calls, result.stderr


def _pip_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m pip install")]


def test_the_demo_installs_the_package_without_the_development_tools(checkout: Path) -> None:
    calls, stderr = _run(checkout, "scripts/demo.sh", "--rows", "10")
    assert _pip_installs(calls) == ["-m pip install -q -e ."]
    assert calls[-1] == "-m arrow_ipc_bridge demo --rows 10"
    # the slow step is announced before it runs
    assert "setup-venv: installing the package and its runtime dependencies" in stderr
    # a second run installs nothing and says nothing
    calls, stderr = _run(checkout, "scripts/demo.sh")
    assert _pip_installs(calls) == []
    assert stderr == ""


def test_the_default_mode_installs_the_development_tools(checkout: Path) -> None:
    calls, stderr = _run(checkout, "scripts/setup-venv.sh")
    assert _pip_installs(calls) == ["-m pip install -q -e .[dev] setuptools>=77"]
    assert "development tools" in stderr
    # a development install covers the demo's
    calls, _ = _run(checkout, "scripts/demo.sh")
    assert _pip_installs(calls) == []


def test_a_runtime_install_is_not_taken_for_a_development_one(checkout: Path) -> None:
    _run(checkout, "scripts/demo.sh")
    calls, _ = _run(checkout, "scripts/setup-venv.sh", "dev")
    assert _pip_installs(calls) == ["-m pip install -q -e .[dev] setuptools>=77"]


def test_changed_dependencies_install_again(checkout: Path) -> None:
    _run(checkout, "scripts/demo.sh")
    pyproject = checkout / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# changed\n")
    calls, _ = _run(checkout, "scripts/demo.sh")
    assert _pip_installs(calls) == ["-m pip install -q -e ."]


def test_an_unknown_mode_is_refused(checkout: Path) -> None:
    result = subprocess.run(
        ["bash", "scripts/setup-venv.sh", "everything"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "usage:" in result.stderr
    assert not os.path.exists(checkout / "calls.log")
