"""The command line's frame: one help text, ``--version``, hidden internal subcommands, the
program's name, argument checks, and ``demo`` run as a user would (``inspect``, ``list`` and
``doctor`` have files of their own)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli_runner import REPO, run_cli

from arrow_ipc_bridge import __version__
from arrow_ipc_bridge._ffi import WIRE_VERSION
from arrow_ipc_bridge.cli import main


def test_a_subcommand_is_required() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "required" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_the_public_subcommands_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--help names demo, list, inspect and doctor; the internal _producer/_consumer stay hidden."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "list", "inspect", "doctor"):
        assert re.search(rf"^\s+{command}\s", out, re.MULTILINE), command
    assert "_producer" not in out
    assert "_consumer" not in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"arrow_ipc_bridge {__version__} (wire format {WIRE_VERSION[0]}.{WIRE_VERSION[1]})"
    )


@pytest.mark.parametrize(
    ("argv0", "prog"),
    [
        ("/x/lib/python3/site-packages/arrow_ipc_bridge/__main__.py", "python -m arrow_ipc_bridge"),
        ("/x/bin/arrow-ipc-bridge", "arrow-ipc-bridge"),
    ],
)
def test_the_program_names_itself_as_it_was_called(
    argv0: str, prog: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")


def test_the_console_script_names_itself() -> None:
    """The installed ``arrow-ipc-bridge`` script says ``arrow-ipc-bridge`` in its usage line."""
    script = shutil.which("arrow-ipc-bridge", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the console script is not installed next to this interpreter")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: arrow-ipc-bridge ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--columns", "0"], "argument --columns: must be at least 1, got 0"),
        (["--rows", "-5"], "argument --rows: must be at least 1, got -5"),
        (["--rows", "0"], "argument --rows: must be at least 1, got 0"),
        (["--rows", "many"], "argument --rows: expected a whole number, got 'many'"),
    ],
)
def test_demo_refuses_bad_options(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error (exit 2) naming the option, before any process starts."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "x.bin", "--fds", "-1"], "argument --fds: must not be negative, got -1"),
        (["list", "x.sock", "--timeout", "0"], "argument --timeout: must be a positive number of seconds"),
        (["list", "x.sock", "--timeout", "nan"], "argument --timeout: must be a positive number of seconds"),
    ],
)
def test_other_options_are_checked(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_shares_a_table_between_two_processes() -> None:
    """demo starts a producer and a consumer process; the consumer lists the names and reads both host
    tables, whose last column sums to the expected value; both processes exit 0."""
    rows, columns = 1000, 3
    result = run_cli("demo", "--rows", str(rows), "--columns", str(columns))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"producer pid \d+: published ", out)
    assert re.search(r"consumer pid \d+: publisher serves \[.*'copied'.*'zero_copy'.*\]", out)
    expected_sum = float(columns - 1) * rows  # column c{i} holds the value i in every row
    for name in ("copied", "zero_copy"):
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert line.endswith(f"last column sums to {expected_sum}"), line
    # the memory-mapped table needs no copy at all
    assert re.search(r"'zero_copy' \(0 bytes copied, 1 zero-copy region\)", out)


GOLDEN_MESSAGE = os.path.join(os.path.dirname(__file__), "golden", "primitive_batch.bin")


@pytest.mark.parametrize(
    "args",
    [
        ["doctor", "--no-cuda-processes"],
        ["doctor", "--no-cuda-processes", "--json"],
        ["inspect", "--json", GOLDEN_MESSAGE],
        ["inspect", GOLDEN_MESSAGE],
    ],
)
def test_a_reader_that_went_away_ends_the_command_quietly(args: list[str]) -> None:
    """``... | head``: stdout's reader is gone before the command writes (the pipe's read end is
    closed before it starts, so every run sees it). No traceback, and the status a command killed by
    SIGPIPE gets (141), as other Unix tools give."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "arrow_ipc_bridge", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141


def test_serve_flight_without_credentials_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal names this command's flags, not serve()'s keyword arguments."""
    assert main(["serve-flight", "/nonexistent/publisher.sock"]) == 1
    err = capsys.readouterr().err
    assert "anyone who reaches it" in err
    for flag in ("--token-file", "--client-ca", "--allow-unauthenticated"):
        assert flag in err
    assert "tokens=" not in err
    assert "allow_unauthenticated=" not in err
    assert len(err.strip().splitlines()) == 1


def test_serve_flight_refuses_a_client_ca_without_tls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Client certificates are asked for over TLS only: a --client-ca on a plain grpc:// location
    would check nothing and serve everyone, so it is refused."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert main(["serve-flight", "/nonexistent/publisher.sock", "--client-ca", str(ca)]) == 1
    assert "--client-ca needs TLS" in capsys.readouterr().err


def test_demo_help_describes_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "producer process" in out
    assert "consumer process" in out
