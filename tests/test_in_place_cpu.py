"""The producer's in-place path for CUDA columns and the table of column facts that live
publications hold (``device.hold_checked_columns``), without a GPU: each scenario runs in a child
process over a stand-in driver (tests/helpers/fake_libcuda.c, compiled here; every driver call
answers at C speed and counts), so the bridge's own logic runs as it does on a GPU. The GPU side is
tests/test_gpu_fastpath.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from arrow_ipc_bridge.cuda._declarations import _declared_functions

_TESTS = Path(__file__).resolve().parent
_ROOT = _TESTS.parent


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The stand-in driver, built: fake_libcuda.c plus a stub answering CUDA_SUCCESS for every other
    function the bridge declares (its loader checks that all of them exist)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver")
    source = (_TESTS / "helpers" / "fake_libcuda.c").read_text()
    defined = set(re.findall(r"^int (cu\w+)\(", source, flags=re.MULTILINE))
    stubs = "".join(
        f"int {name}(void) {{ return 0; }}\n" for name in _declared_functions() if name not in defined
    )
    folder = tmp_path_factory.mktemp("fake_libcuda")
    (folder / "fake.c").write_text(source + "\n" + stubs)
    library = folder / "libfakecuda.so"
    subprocess.run(
        [compiler, "-O1", "-shared", "-fPIC", "-o", str(library), str(folder / "fake.c")],
        check=True,
        capture_output=True,
    )
    return str(library)


def _run(fake_libcuda: str, scenario: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["ARROW_IPC_BRIDGE_LIBCUDA"] = fake_libcuda
    env["PYTHONPATH"] = os.pathsep.join([str(_TESTS), str(_ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "helpers.fake_cuda_children", scenario],
        check=False,
        cwd=_TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_same_columns_renew_the_version_and_others_take_the_full_path(fake_libcuda: str) -> None:
    seen = _run(fake_libcuda, "renewal")
    assert seen["held_first"] == 1  # the first publication's facts are in the table
    # The same columns again: no pointer query (the live publication holds them), renewed in place
    # (one record of the shared event, no wait: no stream announced), a new version, same export.
    assert seen["wrap_same"]["pointer_queries"] == 0
    renewed = {"pointer_queries": 0, "waits": 0, "records": 1, "pushes": 0, "in_place": 1}
    assert seen["publish_same"] == renewed
    assert seen["same_export"]
    assert seen["version_step"] == 1
    # The same memory under other names: not the current version's columns (full path, queried
    # by the placer; the wrap itself asked nothing: the same pointers are held).
    assert seen["other_names"]["in_place"] == 0
    assert seen["renamed_is_new"]
    assert seen["first_closed"]
    # Other columns: the device query of every column, and the full path.
    assert seen["other_columns"]["pointer_queries"] >= 4
    assert seen["other_columns"]["in_place"] == 0
    assert seen["renamed_closed"]
    assert seen["held_other"] == 1
    # Columns of a publication that was replaced and closed: queried again, full path.
    assert seen["wrap_replaced"]["pointer_queries"] == 4
    assert seen["publish_replaced"]["in_place"] == 0
    # Unpublished: nothing held; the next publish of the same columns is a new publication.
    assert seen["held_unpublished"] == 0
    assert seen["publish_unpublished"]["in_place"] == 0
    assert seen["publish_unpublished"]["pointer_queries"] >= 4
    assert seen["held_republished"] == 1
    # Held by a second name's export after the first let go: still no query.
    assert seen["held_second_name"] == 1
    assert seen["wrap_second_name"]["pointer_queries"] == 0
    assert seen["held_closed"] == 0  # the publisher closed: every export closed, the table empty


def test_the_in_place_record_waits_only_for_a_real_stream(fake_libcuda: str) -> None:
    seen = _run(fake_libcuda, "streams")
    for label in ("none", "legacy"):  # recorded on the legacy default stream: ordered already
        assert seen[label]["in_place"] == 1, label
        assert seen[label]["waits"] == 0, label
    # A real stream: an event recorded on it (with the structs), the shared event's record waits for it.
    assert seen["real"]["in_place"] == 1
    assert seen["real"]["waits"] == 1
    assert seen["real"]["records"] == 2


def test_an_address_no_live_publication_holds_is_checked_again(fake_libcuda: str) -> None:
    """The table never spares a query for memory its publication let go: the same address, now
    pinned host memory (freed and handed out again), is refused at the call."""
    assert _run(fake_libcuda, "reused_address") == {"error": "InvalidArgumentError"}


def test_a_closed_publisher_renews_nothing(fake_libcuda: str) -> None:
    seen = _run(fake_libcuda, "closed")
    assert seen["error"] == "ClosedError"
    assert seen["publish_closed"]["records"] == 0
    assert seen["publish_closed"]["in_place"] == 0
    assert seen["held"] == 0


def test_the_record_pushes_the_primary_context_only_when_another_is_current(fake_libcuda: str) -> None:
    seen = _run(fake_libcuda, "context")
    assert seen["current"]["in_place"] == 1
    assert seen["current"]["pushes"] == 0
    assert seen["none_current"]["in_place"] == 1
    assert seen["none_current"]["pushes"] == 1
    assert seen["current_after"] is None  # popped: the thread's context is as it was


def test_a_forked_child_asks_about_columns_its_parent_holds(fake_libcuda: str) -> None:
    assert _run(fake_libcuda, "forked") == {"child": "CudaError", "held_parent": 1}


def test_renewals_in_place_one_after_another(fake_libcuda: str) -> None:
    """Each renewal of the same columns is one record, no wait, no query, a new version and the same
    stats; a copy policy given renews too; other columns, a forked child and a closed publisher
    renew nothing."""
    seen = _run(fake_libcuda, "renewals")
    assert seen["five"] == {"pointer_queries": 0, "waits": 0, "records": 5, "pushes": 0, "in_place": 5}
    assert seen["version_steps"] == 5
    assert seen["same_stats"]
    assert seen["policy_given"]["in_place"] == 1
    assert seen["forked_child"] == "ClosedError"
    # Other columns, then the first ones again: two new publications, nothing renewed.
    assert seen["other_columns"]["in_place"] == 0
    # Closed: ClosedError; nothing recorded or renewed.
    assert seen["closed"] == "ClosedError"
    assert not any(seen["publish_closed"].values())


def test_a_renewal_answers_the_one_wait_held_on_its_name(fake_libcuda: str) -> None:
    """A single WAIT held on the name (a consumer's get_next) is answered by the renewal with the new
    version at once, not left to its timeout."""
    seen = _run(fake_libcuda, "renewal_answers_a_single_wait")
    assert seen["held"] == 1
    assert seen["renewed"] == 1
    assert seen["answer"] is True, seen["answer"]
    assert seen["answered_version"] == seen["version"]
