#!/usr/bin/env python3
"""Mutation testing: does the test suite catch the one-line bugs real changes introduce?

Each mutant in ``tests/mutation/mutants.toml`` names a source file, an exact snippet of it, the
snippet's replacement, a one-line description and the tests that judge it. For each mutant this
script, working in a scratch copy of the tree (the working tree is never modified):

1. replaces the snippet (it must occur exactly once: a snippet that is gone is *stale*, one that
   occurs twice is *ambiguous*; either fails the run, so the list cannot rot silently);
2. rebuilds the C core (``setup.py build_ext --inplace --force``) when the file is a ``.c``;
3. runs ``pytest -x -q`` over the mutant's judges, with a fixed hypothesis seed (reproducible);
4. records *killed* (a test failed or the process crashed), *survived* (every judge passed),
   *build-error* (the mutant does not compile: a broken list entry) or *timeout*; then restores
   the file (and the pristine C core).

Before the mutants, the judges run once against the unmodified tree: a judge that fails there would
"kill" every mutant, so the run stops. The score is (killed + timeout) / (killed + timeout + survived).

Usage (from the repository root, with the project's virtual environment)::

    .venv/bin/python scripts/mutate.py                 # every mutant; prints a table and the score
    .venv/bin/python scripts/mutate.py --only owner-release-moved-child --only capsules-...
    .venv/bin/python scripts/mutate.py --check         # only check that every snippet applies
    .venv/bin/python scripts/mutate.py --json out.json # also write the results as JSON ('-': stdout)

Exit status: 0 when every mutant applied and built and the score reaches ``--fail-under`` (default
0); 1 otherwise; 2 when a judge fails on the unmodified tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if sys.version_info < (3, 11):  # the package supports 3.10; this tool reads its list with tomllib (3.11+)
    sys.exit(
        f"scripts/mutate.py needs Python 3.11 or newer (it reads tests/mutation/mutants.toml with "
        f"tomllib); this is Python {sys.version.split()[0]}"
    )

import tomllib  # after the version check: on 3.10 the message above, not an ImportError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LIST = REPO / "tests" / "mutation" / "mutants.toml"
CORE = Path("arrow_ipc_bridge") / "_bridge_core.abi3.so"
# Reproducible judging: hypothesis explores a fixed set of examples for every mutant.
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "--hypothesis-seed=0"]
KILLED, SURVIVED, BUILD_ERROR, TIMEOUT, STALE, AMBIGUOUS, ERROR = (
    "killed",
    "survived",
    "build-error",
    "timeout",
    "stale",
    "ambiguous",
    "error",
)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    original: str
    replacement: str
    description: str
    judges: tuple[str, ...]
    expected_killer: str = ""  # for a known survivor: the test (being) written to kill it


@dataclasses.dataclass
class Result:
    name: str
    file: str
    status: str
    seconds: float
    description: str
    detail: str = ""
    expected_killer: str = ""


def load_mutants(path: Path) -> list[Mutant]:
    """The mutants of a list file; ValueError naming the first malformed entry."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    mutants = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("mutant", [])):
        missing = {"name", "file", "original", "replacement", "description", "judges"} - raw.keys()
        if missing:
            raise ValueError(f"mutant #{i} ({raw.get('name', '?')}) lacks {sorted(missing)}")
        if raw["name"] in seen:
            raise ValueError(f"mutant name {raw['name']!r} is used twice")
        if raw["original"] == raw["replacement"]:
            raise ValueError(f"mutant {raw['name']!r} replaces its snippet with itself")
        seen.add(raw["name"])
        mutants.append(
            Mutant(
                name=raw["name"],
                file=raw["file"],
                original=raw["original"],
                replacement=raw["replacement"],
                description=raw["description"],
                judges=tuple(raw["judges"]),
                expected_killer=raw.get("expected_killer", ""),
            )
        )
    return mutants


def snippet_status(tree: Path, mutant: Mutant) -> str | None:
    """STALE or AMBIGUOUS when the mutant cannot be applied to ``tree``, else None."""
    path = tree / mutant.file
    if not path.is_file():
        return STALE
    count = path.read_text().count(mutant.original)
    if count == 0:
        return STALE
    return AMBIGUOUS if count > 1 else None


def copy_tree(destination: Path) -> None:
    """Copy the files git knows of (tracked, and untracked but not ignored) into ``destination``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        relative = Path(os.fsdecode(raw))
        source = REPO / relative
        if not source.is_file():  # deleted in the working tree but still in the index
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def run(command: list[str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    """(exit status or None on timeout, the output's tail). The command runs in its own process
    group, killed whole on timeout (pytest may have started children)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(cwd)  # the scratch copy's package, not the editable install's
    env.pop("HYPOTHESIS_PROFILE", None)
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return None, output.decode(errors="replace")[-2000:]
    return process.returncode, output.decode(errors="replace")[-2000:]


def build_core(tree: Path, timeout: float) -> tuple[bool, str]:
    rc, output = run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"], tree, timeout)
    return rc == 0, output


def judge(tree: Path, judges: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    return run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *judges], tree, timeout)


def classify(rc: int | None) -> str:
    if rc is None:
        return TIMEOUT
    if rc == 0:
        return SURVIVED
    # 1: a test failed; negative: killed by a signal (a crash, e.g. SIGSEGV, counts as caught).
    if rc == 1 or rc < 0:
        return KILLED
    return ERROR  # 2-5: interrupted, internal error, usage error, no tests collected


def last_line(output: str) -> str:
    """The test that caught the mutant (pytest's short summary, -ra) if any, else the last line."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    caught = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return (caught or lines or [""])[-1][:200]


def run_mutant(tree: Path, mutant: Mutant, pristine_core: bytes, timeout: float) -> Result:
    started = time.monotonic()
    path = tree / mutant.file
    original_text = path.read_text()
    is_c = mutant.file.endswith((".c", ".h"))
    status, detail = "", ""
    try:
        path.write_text(original_text.replace(mutant.original, mutant.replacement, 1))
        if is_c:
            built, output = build_core(tree, timeout)
            if not built:
                status, detail = BUILD_ERROR, last_line(output)
        if not status:
            rc, output = judge(tree, mutant.judges, timeout)
            status, detail = classify(rc), last_line(output)
            if rc is not None and rc < 0:
                detail = f"crashed with signal {-rc}: {detail}"
    finally:
        path.write_text(original_text)
        if is_c:
            (tree / CORE).write_bytes(pristine_core)
    return Result(
        mutant.name,
        mutant.file,
        status,
        round(time.monotonic() - started, 1),
        mutant.description,
        detail,
        mutant.expected_killer,
    )


def print_table(results: list[Result]) -> None:
    width = max([len(r.name) for r in results] + [6])
    print(f"\n{'mutant':<{width}}  {'status':<11} {'secs':>6}  description")
    for r in results:
        print(f"{r.name:<{width}}  {r.status:<11} {r.seconds:>6.1f}  {r.description}")
    survivors = [r for r in results if r.status == SURVIVED]
    if survivors:
        print("\nSurvivors and the tests expected to kill them:")
        for r in survivors:
            print(f"  {r.name}: {r.expected_killer or '(no test named yet)'}")
    broken = [r for r in results if r.status in (STALE, AMBIGUOUS, BUILD_ERROR, ERROR)]
    if broken:
        print("\nEntries to fix in the mutant list:")
        for r in broken:
            print(f"  {r.name} ({r.file}): {r.status} {r.detail}")


def score(results: list[Result]) -> tuple[int, int, float]:
    caught = sum(r.status in (KILLED, TIMEOUT) for r in results)
    judged = caught + sum(r.status == SURVIVED for r in results)
    return caught, judged, (100.0 * caught / judged if judged else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", type=Path, default=DEFAULT_LIST, help="the mutant list (TOML)")
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="run this mutant (repeatable)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per mutant's build and per judge run"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH ('-': stdout)")
    parser.add_argument("--check", action="store_true", help="only check that every snippet applies")
    parser.add_argument(
        "--skip-baseline", action="store_true", help="do not run the judges on the unmodified tree"
    )
    parser.add_argument("--keep-scratch", action="store_true", help="leave the scratch copy for inspection")
    parser.add_argument("--fail-under", type=float, default=0.0, help="fail when the score (%%) is lower")
    args = parser.parse_args(argv)

    mutants = load_mutants(args.list)
    order = {m.name: i for i, m in enumerate(mutants)}  # the list's order, for the table
    if args.only:
        unknown = set(args.only) - {m.name for m in mutants}
        if unknown:
            parser.error(f"no mutant named {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m.name in args.only]

    results: list[Result] = []
    runnable: list[Mutant] = []
    for m in mutants:
        problem = snippet_status(REPO, m)
        if problem:
            results.append(
                Result(m.name, m.file, problem, 0.0, m.description, "snippet not found exactly once")
            )
        else:
            runnable.append(m)
    if args.check:
        if results:
            print_table(results)
        print(f"{len(runnable)} of {len(mutants)} mutants apply")
        return 1 if results else 0

    scratch = Path(tempfile.mkdtemp(prefix="aib-mutate-"))
    try:
        copy_tree(scratch)
        built, output = build_core(scratch, args.timeout)
        if not built:
            print(f"the unmodified C core does not build:\n{output}", file=sys.stderr)
            return 2
        pristine_core = (scratch / CORE).read_bytes()
        if not args.skip_baseline and runnable:
            judges = tuple(dict.fromkeys(j for m in runnable for j in m.judges))
            print(f"baseline: {len(judges)} judges on the unmodified tree ...", flush=True)
            rc, output = judge(scratch, judges, args.timeout * 4)
            if rc != 0:
                print(f"the judges fail on the unmodified tree (status {rc}):\n{output}", file=sys.stderr)
                return 2
        for n, m in enumerate(runnable, 1):
            print(f"[{n}/{len(runnable)}] {m.name} ...", end=" ", flush=True)
            result = run_mutant(scratch, m, pristine_core, args.timeout)
            print(f"{result.status} ({result.seconds:.0f} s)", flush=True)
            results.append(result)
    finally:
        if args.keep_scratch:
            print(f"scratch copy kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    results.sort(key=lambda r: order[r.name])
    print_table(results)
    caught, judged, percent = score(results)
    counts = {
        s: sum(r.status == s for r in results)
        for s in (KILLED, SURVIVED, TIMEOUT, BUILD_ERROR, STALE, AMBIGUOUS, ERROR)
    }
    print(
        f"\nscore: {caught}/{judged} = {percent:.0f}% caught  "
        + ", ".join(f"{k} {v}" for k, v in counts.items() if v)
    )
    if args.json:
        payload = {
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "score_percent": round(percent, 1),
            "caught": caught,
            "judged": judged,
            "counts": counts,
            "results": [dataclasses.asdict(r) for r in results],
        }
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    broken = any(r.status in (STALE, AMBIGUOUS, BUILD_ERROR, ERROR) for r in results)
    return 1 if broken or percent < args.fail_under else 0


if __name__ == "__main__":
    sys.exit(main())
