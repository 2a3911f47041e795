"""The release artifacts work: ``python -m build`` makes an sdist and a wheel that install and run.

The sdist has to carry everything the C core is compiled from (``cffi_build/``: the cffi builder that
``setup.py`` names, the headers, the C sources); the wheel has to carry the compiled core and the
``py.typed`` marker. The last test installs the sdist into a fresh virtualenv, away from this source
tree, and hands a table from a producer process to a consumer process over a Unix socket.

These tests reach the package index (build isolation fetches setuptools and cffi, the virtualenv
fetches pyarrow) and take about half a minute, so they run only where that is wanted: in CI
(``CI=true``) or with ``RUN_PACKAGING=1``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Installing compiles the C core and may download wheels: generous bounds for a loaded 2-core machine.
STEP_TIMEOUT_S = 600

pytestmark = [
    pytest.mark.packaging,
    pytest.mark.skipif(
        os.environ.get("CI") != "true" and os.environ.get("RUN_PACKAGING") != "1",
        reason="packaging test: builds and installs from the package index; set CI=true or RUN_PACKAGING=1",
    ),
]


def _clean_env() -> dict[str, str]:
    """The environment without anything that would put this source tree on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(args: list[str], *, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, (
        f"{args} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


class Dist:
    """The sdist and wheel built once for the module."""

    def __init__(self, outdir: Path, build_log: str) -> None:
        self.build_log = build_log  # what `python -m build` printed (stdout and stderr)
        sdists = sorted(outdir.glob("*.tar.gz"))
        wheels = sorted(outdir.glob("*.whl"))
        assert len(sdists) == 1, sdists
        assert len(wheels) == 1, wheels
        self.sdist = sdists[0]
        self.wheel = wheels[0]

    def sdist_members(self) -> set[str]:
        with tarfile.open(self.sdist) as tar:
            # Strip the leading "arrow_ipc_bridge-<version>/".
            return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}

    def wheel_members(self) -> set[str]:
        with zipfile.ZipFile(self.wheel) as whl:
            return set(whl.namelist())


def _clean_checkout(dest: Path) -> Path:
    """A copy of the files git would check out (tracked, plus new files not ignored), nothing else.

    Building in the working tree would not test the manifest: setuptools also reads the
    SOURCES.txt of an ``*.egg-info`` left there by an editable install or an earlier build, and
    ships what that lists even when MANIFEST.in would not.
    """
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted in the work tree but not yet in the index is skipped
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    source = _clean_checkout(tmp_path_factory.mktemp("checkout"))
    outdir = tmp_path_factory.mktemp("dist")
    # The default `python -m build` builds the sdist, then the wheel *from the sdist*: the wheel
    # build fails on its own when the sdist lacks a file the C core needs.
    built = _run([sys.executable, "-m", "build", "--outdir", str(outdir), str(source)], cwd=source)
    return Dist(outdir, built.stdout + built.stderr)


def _tracked_inputs(folder: str, suffixes: tuple[str, ...]) -> set[str]:
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts
    }


def test_sdist_carries_what_the_c_core_is_built_from(dist: Dist) -> None:
    members = dist.sdist_members()
    needed = _tracked_inputs("cffi_build", (".py", ".h", ".c")) | {
        "setup.py",
        "pyproject.toml",
        "LICENSE",
        "README.md",
        "arrow_ipc_bridge/py.typed",
    }
    assert "cffi_build/build_bridge.py" in needed
    assert needed - members == set()
    # Build products never ship in the sdist (the generated C file is rebuilt from the headers).
    assert not {m for m in members if m.endswith((".so", ".o", ".pyc"))}
    assert "arrow_ipc_bridge/_bridge_core.c" not in members


def test_the_license_is_an_spdx_expression_and_the_build_warns_of_nothing_deprecated(dist: Dist) -> None:
    """``license = "Apache-2.0"`` (not the table form setuptools 77 deprecates) reaches the wheel's
    metadata as a License-Expression, and the build prints no deprecation warning."""
    with zipfile.ZipFile(dist.wheel) as whl:
        name = next(m for m in whl.namelist() if m.endswith(".dist-info/METADATA"))
        metadata = whl.read(name).decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert "deprecated" not in dist.build_log.lower(), dist.build_log[-4000:]


def test_wheel_carries_the_compiled_core_every_module_and_the_type_marker(dist: Dist) -> None:
    members = dist.wheel_members()
    assert [m for m in members if m.startswith("arrow_ipc_bridge/_bridge_core") and m.endswith(".so")]
    assert "arrow_ipc_bridge/py.typed" in members
    # Every module of the package, subpackages included, is in the wheel.
    modules = _tracked_inputs("arrow_ipc_bridge", (".py",))
    assert modules - members == set()
    assert any(m.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")) for m in members)
    # Build inputs are not part of the installed package.
    assert not [m for m in members if m.startswith("cffi_build/")]


PRODUCER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    import arrow_ipc_bridge as aib

    table = pa.table({"id": pa.array(range(1000), pa.int64()),
                      "x": pa.array([i * 0.5 for i in range(1000)], pa.float64()),
                      "s": pa.array([f"row{i}" if i % 7 else None for i in range(1000)])})
    with aib.Publisher(sys.argv[1]) as pub:
        pub.publish("smoke", table)
        print("ready", aib.__file__, flush=True)
        sys.stdin.read()  # serve until the test closes our stdin
    """
)

CONSUMER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    import arrow_ipc_bridge as aib

    with aib.connect(sys.argv[1], timeout=30.0) as session:
        assert session.list() == ["smoke"], session.list()
        with session.get("smoke") as imported:
            table = pa.table(imported)
            assert table.num_rows == 1000
            assert table.column("id").to_pylist() == list(range(1000))
            assert table.column("x").to_pylist() == [i * 0.5 for i in range(1000)]
            assert table.column("s").to_pylist() == [f"row{i}" if i % 7 else None for i in range(1000)]
            del table
    print("consumer ok", aib.__file__, flush=True)
    """
)


def test_sdist_installs_in_a_fresh_virtualenv_and_hands_a_table_between_processes(
    dist: Dist, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", str(dist.sdist)], cwd=tmp_path)

    work = tmp_path / "work"  # not the source tree: the import must come from the virtualenv
    work.mkdir()
    (work / "producer.py").write_text(PRODUCER)
    (work / "consumer.py").write_text(CONSUMER)
    socket_path = str(tmp_path / "smoke.sock")
    site = venv / "lib"

    producer = subprocess.Popen(
        [str(python), "producer.py", socket_path],
        cwd=work,
        env=_clean_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert producer.stdout is not None
        ready = producer.stdout.readline()
        assert ready.startswith("ready "), (ready, producer.stderr and producer.stderr.read())
        assert Path(ready.split()[1]).resolve().is_relative_to(site.resolve()), ready

        consumer = _run([str(python), "consumer.py", socket_path], cwd=work)
        assert consumer.stdout.startswith("consumer ok "), consumer.stdout
        assert Path(consumer.stdout.split()[2]).resolve().is_relative_to(site.resolve())
    finally:
        try:
            _, err = producer.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            producer.kill()
            _, err = producer.communicate()
    assert producer.returncode == 0, err
