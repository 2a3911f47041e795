"""The code the docs show runs: every fenced ``python`` block in ``docs/`` that a snippet marker
precedes is run as a reader would run it, as a script in a subprocess, and must exit 0.

A marker is an HTML comment on the line before the block (invisible when the page is rendered):

- ``<!-- snippet: host -->``: a script that runs on any machine the bridge supports;
- ``<!-- snippet: gpu -->``: one that needs a CUDA GPU (marked ``gpu``; skipped with the reason
  where there is none, run by ``scripts/gpu-check.sh`` where there is);
- ``<!-- snippet: host publisher -->`` / ``<!-- snippet: gpu publisher -->``: a producer that
  serves until Enter is pressed (its ``input()`` prompt says ``press Enter to stop``, after it has
  published). It is not run on its own: it is started, once per test module, for the snippets that
  name its socket path.

Socket paths in snippets are literals of the form ``/tmp/aib-NAME.sock``, which a reader can run as
they are; here each one is moved into a fresh temporary directory, the same way for a publisher and
the snippets that connect to it. A snippet names at most one socket path, and every path a snippet
names must be served by exactly one publisher snippet. A snippet that names none runs on its own.

Snippets check what they print with ``assert``, so a snippet whose result is wrong fails here. A
marker this file does not know, or one not followed by a ``python`` block, fails the collection
(a typo must not quietly leave a snippet unchecked), and the pages the docs promise must each have
a checked snippet.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.optional_modules import import_failure

REPO = Path(__file__).parent.parent
DOCS = REPO / "docs"
RUN_TIMEOUT_S = 120  # a snippet takes a second or two; generous for 2 busy CI cores
START_TIMEOUT_S = 120  # a GPU publisher initialises CUDA before it publishes
STOP_TIMEOUT_S = 60
READY = "press Enter to stop"

# A marker is a line of its own (a marker quoted in running text is not one); the colon is checked
# after the match, so that ``<!-- snippet host -->`` is an error rather than no marker.
MARKER = re.compile(r"<!--\s*snippet\b(:?)(.*?)-->")
SOCKET = re.compile(r"/tmp/aib-[A-Za-z0-9_-]+\.sock")
KINDS = {"host", "gpu"}

# The pages the docs promise, each with the kind of snippet it must show (docs/README.md lists them).
REQUIRED_PAGES = {
    "quickstart.md": "host",
    "troubleshooting.md": "host",
    "consumers/pyarrow.md": "host",
    "consumers/polars.md": "host",
    "consumers/pandas.md": "host",
    "consumers/duckdb.md": "host",
    "consumers/nanoarrow.md": "host",
    "consumers/cupy-pytorch.md": "gpu",
    "consumers/cudf.md": "gpu",
}


@dataclass(frozen=True)
class Snippet:
    """One marked block: where it is, what it needs, its code."""

    page: str  # relative to docs/
    line: int  # of the opening fence, 1-based
    kind: str  # "host" or "gpu"
    publisher: bool
    code: str

    @property
    def ident(self) -> str:
        return f"{self.page}:{self.line}"

    def sockets(self) -> set[str]:
        return set(SOCKET.findall(self.code))

    def imports(self) -> set[str]:
        """Top-level packages the snippet imports."""
        names: set[str] = set()
        for node in ast.walk(ast.parse(self.code)):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        return names


def extract(text: str, page: str) -> list[Snippet]:
    """The marked blocks of one page. ``ValueError`` for a marker that is not understood or not
    followed by a ``python`` block."""
    lines = text.splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        marker = MARKER.fullmatch(lines[i].strip())
        if marker is None:
            i += 1
            continue
        words = marker.group(2).split()
        if not marker.group(1) or not words or words[0] not in KINDS or words[1:] not in ([], ["publisher"]):
            raise ValueError(
                f"{page}:{i + 1}: unknown snippet marker {marker.group(0)!r} "
                "(host, gpu, 'host publisher' or 'gpu publisher')"
            )
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or lines[j].strip() != "```python":
            raise ValueError(f"{page}:{i + 1}: a snippet marker must be followed by a ```python block")
        end = j + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{j + 1}: the ```python block is not closed")
        code = "\n".join(lines[j + 1 : end]) + "\n"
        found.append(Snippet(page, j + 1, words[0], words[1:] == ["publisher"], code))
        i = end + 1
    return found


def all_snippets() -> list[Snippet]:
    snippets: list[Snippet] = []
    for path in sorted(DOCS.rglob("*.md")):
        snippets += extract(path.read_text(encoding="utf-8"), path.relative_to(DOCS).as_posix())
    return snippets


SNIPPETS = all_snippets()
CONSUMERS = [s for s in SNIPPETS if not s.publisher]
PUBLISHERS = {path: s for s in SNIPPETS if s.publisher for path in s.sockets()}


def localised(code: str, directory: str) -> str:
    """``code`` with each ``/tmp/aib-NAME.sock`` moved into ``directory``."""
    return SOCKET.sub(lambda m: os.path.join(directory, os.path.basename(m.group(0))), code)


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_code(code: str, workdir: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script in ``workdir`` with this Python; never raises for the script's failure."""
    script = os.path.join(workdir, f"snippet-{time.monotonic_ns()}.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(code)
    try:
        return subprocess.run(
            [sys.executable, script],
            cwd=workdir,
            env=_environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(
            exc.cmd, -9, str(exc.stdout or ""), f"{exc.stderr or ''}\n[timed out after {timeout} s]"
        )


def _report(snippet: Snippet, result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"{snippet.ident} exited {result.returncode}\n--- code\n{snippet.code}"
        f"--- stdout\n{result.stdout}--- stderr\n{result.stderr}"
    )


class RunningPublisher:
    """A publisher snippet running in a subprocess until :meth:`stop` presses Enter."""

    def __init__(self, snippet: Snippet, directory: str) -> None:
        self.snippet = snippet
        base = os.path.join(directory, f"publisher-{snippet.page.replace('/', '-')}-{snippet.line}")
        self.out_path, self.err_path = base + ".out", base + ".err"
        with open(base + ".py", "w", encoding="utf-8") as f:
            f.write(localised(snippet.code, directory))
        # Output goes to files, read while it runs: a pipe nobody reads could fill and stall it.
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, base + ".py"],
                cwd=directory,
                env=_environment(),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                text=True,
            )

    def output(self) -> tuple[str, str]:
        with open(self.out_path, encoding="utf-8") as out, open(self.err_path, encoding="utf-8") as err:
            return out.read(), err.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY not in self.output()[0]:
            if self.process.poll() is not None or time.monotonic() > deadline:
                stdout, stderr = self.output()
                raise AssertionError(
                    f"publisher {self.snippet.ident} did not get ready (exit {self.process.poll()})\n"
                    f"--- stdout\n{stdout}--- stderr\n{stderr}"
                )
            time.sleep(0.05)

    def stop(self) -> tuple[int, str, str]:
        """Press Enter; returns its exit code and output (killed, -9, if it does not stop)."""
        with contextlib.suppress(BrokenPipeError, OSError):
            assert self.process.stdin is not None
            self.process.stdin.write("\n")
            self.process.stdin.close()
        try:
            code = self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = -9
        stdout, stderr = self.output()
        return code, stdout, stderr


class Publishers:
    """The publisher snippets started for this module, by socket path, each started on first use."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.running: dict[str, RunningPublisher] = {}

    def ensure(self, socket_path: str) -> None:
        if socket_path not in self.running:
            snippet = PUBLISHERS[socket_path]
            publisher = RunningPublisher(snippet, self.directory)
            for path in snippet.sockets():
                self.running[path] = publisher
            publisher.wait_ready()

    def stop_all(self) -> list[str]:
        """Stop every publisher; the reports of those that did not exit cleanly."""
        failures = []
        for publisher in {id(p): p for p in self.running.values()}.values():
            code, stdout, stderr = publisher.stop()
            if code != 0 or "Traceback" in stderr:
                failures.append(
                    f"publisher {publisher.snippet.ident} exited {code}\n"
                    f"--- stdout\n{stdout}--- stderr\n{stderr}"
                )
        self.running.clear()
        return failures


@pytest.fixture(scope="module")
def publishers() -> Iterator[Publishers]:
    directory = tempfile.mkdtemp(dir="/tmp", prefix="aibd-")  # short: AF_UNIX paths are limited to ~107 bytes
    started = Publishers(directory)
    try:
        yield started
    finally:
        failures = started.stop_all()
        shutil.rmtree(directory, ignore_errors=True)
    assert failures == [], "\n".join(failures)


def _missing_modules(snippet: Snippet) -> list[str]:
    """The snippet's imports that do not import here, each with why."""
    failures = ((name, import_failure(name)) for name in snippet.imports())
    return sorted(f"{name} ({why})" for name, why in failures if why is not None)


# --- the snippets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "snippet",
    [pytest.param(s, id=s.ident, marks=[pytest.mark.gpu] if s.kind == "gpu" else []) for s in CONSUMERS],
)
def test_snippet_runs(snippet: Snippet, publishers: Publishers, request: pytest.FixtureRequest) -> None:
    if snippet.kind == "gpu":
        request.getfixturevalue("cuda_device")  # skips with the reason where there is no GPU
    sockets = sorted(snippet.sockets())
    needs = [*_missing_modules(snippet)]
    if sockets:
        needs += _missing_modules(PUBLISHERS[sockets[0]])
    if needs:
        pytest.skip(f"{snippet.ident} needs {', '.join(sorted(set(needs)))}")
    for path in sockets:
        publishers.ensure(path)
    result = run_code(localised(snippet.code, publishers.directory), publishers.directory)
    assert result.returncode == 0, _report(snippet, result)
    assert "Traceback" not in result.stderr, _report(snippet, result)


# --- the rules the snippets follow ------------------------------------------------------------------------


def test_the_promised_pages_have_checked_snippets() -> None:
    for page, kind in REQUIRED_PAGES.items():
        assert (DOCS / page).is_file(), f"docs/{page} is missing"
        assert [s for s in CONSUMERS if s.page == page and s.kind == kind], (
            f"docs/{page} has no <!-- snippet: {kind} --> block"
        )


def test_every_socket_has_one_publisher_and_every_publisher_is_used() -> None:
    publisher_paths: list[str] = []
    for s in SNIPPETS:
        if s.publisher:
            assert s.sockets(), f"publisher {s.ident} names no /tmp/aib-NAME.sock path"
            assert READY in s.code, f"publisher {s.ident} must wait with input('... {READY}')"
            publisher_paths += sorted(s.sockets())
    assert len(publisher_paths) == len(set(publisher_paths)), (
        f"a socket path has two publishers: {publisher_paths}"
    )
    used: set[str] = set()
    for s in CONSUMERS:
        assert len(s.sockets()) <= 1, f"{s.ident} names several socket paths: {sorted(s.sockets())}"
        for path in s.sockets():
            assert path in PUBLISHERS, f"{s.ident} connects to {path}, which no publisher snippet serves"
            if s.kind == "host":
                assert PUBLISHERS[path].kind == "host", f"host snippet {s.ident} needs a GPU publisher"
            used.add(path)
    assert sorted(set(PUBLISHERS) - used) == [], "publisher snippets no snippet connects to"


def test_markers_are_checked(tmp_path: Path) -> None:
    """Unmarked blocks are left alone, marked ones found with their kind and line; a misspelt marker
    or a marker without a python block is an error, not a skipped snippet."""
    page = "\n".join(
        [
            "# t",
            "Text that quotes a marker, `<!-- snippet: host -->`, is not one.",
            "```python",
            "print('not marked')",
            "```",
            "<!-- snippet: host -->",
            "```python",
            "print('marked')",
            "```",
            "<!-- snippet: gpu publisher -->",
            "",
            "```python",
            "input('press Enter to stop')",
            "```",
        ]
    )
    found = extract(page, "t.md")
    assert [(s.line, s.kind, s.publisher, s.code) for s in found] == [
        (7, "host", False, "print('marked')\n"),
        (12, "gpu", True, "input('press Enter to stop')\n"),
    ]
    for bad in (
        "<!-- snippet: hots -->\n```python\nx = 1\n```",
        "<!-- snippet host -->\n```python\nx = 1\n```",
        "<!-- snippet: host extra -->\n```python\nx = 1\n```",
        "<!-- snippet: host -->\n```bash\nls\n```",
        "<!-- snippet: host -->\n```python\nx = 1\n",
    ):
        with pytest.raises(ValueError, match=r"t\.md:\d+"):
            extract(bad, "t.md")


def test_a_failing_snippet_fails(tmp_path: Path) -> None:
    """What the snippet tests assert on: a wrong result (an assert) and an error exit both show."""
    failed = run_code("assert 1 + 1 == 3, 'wrong'\n", str(tmp_path))
    assert failed.returncode != 0
    assert "AssertionError: wrong" in failed.stderr
    assert run_code("raise SystemExit(3)\n", str(tmp_path)).returncode == 3
    assert run_code("print('fine')\n", str(tmp_path)).stdout == "fine\n"


def test_socket_paths_move_into_the_test_directory() -> None:
    code = 'aib.Publisher("/tmp/aib-one.sock"); aib.connect("/tmp/aib-one.sock")\n'
    assert (
        localised(code, "/tmp/aibd-x")
        == 'aib.Publisher("/tmp/aibd-x/aib-one.sock"); aib.connect("/tmp/aibd-x/aib-one.sock")\n'
    )
