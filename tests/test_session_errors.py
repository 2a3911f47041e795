"""The session facing a broken publisher: corrupted ITEM messages, malformed ERROR replies and
WELCOMEs, surplus descriptors, unusable descriptors given to ``import_message``. Each raises its
documented error and leaks nothing.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py): open descriptors, the C core's
live owners, struct nodes and mappings, the reaper's pending callbacks and this process's threads
return to what they were before the test.
"""

from __future__ import annotations

import fcntl
import os
import queue

import pyarrow as pa
import pytest
from helpers.arrow_equality import assert_arrays_equal
from helpers.session_rig import FakePublisher, fd_count, sample_table, settle, wait_for
from helpers.wire_craft import encode_item

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.transport import protocol
from arrow_ipc_bridge.wire.metadata import Decoded

pytestmark = pytest.mark.usefixtures("no_leaks")


def with_device(message: bytes, device_type: int) -> bytes:
    """``message`` (a CPU message: device type 1 at byte 16) claiming another one-byte device type."""
    assert message[16] == 1
    return message[:16] + bytes([device_type]) + message[17:]


def test_corrupted_item_messages_raise_wire_format_error(sock_dir: str) -> None:
    """A publisher that answers GET with a corrupted ITEM (flipped header bytes, truncated, padded, fds
    missing, payload shorter than a lease id) makes ``session.get`` raise ProtocolError; the descriptors that
    came with it are closed, the session gives the lease back (the fake publisher receives exactly one RELEASE
    for that lease id) and stays usable. A valid message whose descriptor is not a file (a pipe), is not
    sealed although the region says so, or is smaller than the region raises ProtocolError too; one that
    claims a device this session cannot map raises ProtocolError or CudaError (CUDA), UnsupportedFormatError
    (a device type this build does not import), with the same guarantees."""
    exported = aib.export(sample_table(300))
    message, fds = exported.message, exported.fds
    read_end, write_end = os.pipe()
    decoded = Decoded(message, len(fds))
    region_size = decoded.regions()[0].size
    decoded.close()
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, region_size)
    too_small = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(too_small, region_size // 2)
    fcntl.fcntl(too_small, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    cases: list[tuple[str, type[Exception] | tuple[type[Exception], ...], bytes, list[int], bool]] = [
        ("flipped magic", aib.ProtocolError, bytes([message[0] ^ 0xFF]) + message[1:], fds, True),
        (
            "flipped version",
            aib.ProtocolError,
            message[:4] + bytes([message[4] ^ 0x7F]) + message[5:],
            fds,
            True,
        ),
        ("truncated by one", aib.ProtocolError, message[:-1], fds, True),
        ("truncated to half", aib.ProtocolError, message[: len(message) // 2], fds, True),
        ("truncated to the header", aib.ProtocolError, message[:16], fds, True),
        ("empty message", aib.ProtocolError, b"", fds, True),
        ("trailing bytes", aib.ProtocolError, message + b"\x00" * 7, fds, True),
        ("fds missing", aib.ProtocolError, message, [], True),
        ("not a file", aib.ProtocolError, message, [read_end], True),
        # byte 16 is the device type (docs/wire-format.md): a valid message about memory we cannot map
        (
            "device type CUDA, no GPU UUID",
            (aib.ProtocolError, aib.CudaError),
            with_device(message, 2),
            fds,
            True,
        ),
        (
            "device type 7 (an unsupported device)",
            aib.UnsupportedFormatError,
            with_device(message, 7),
            fds,
            True,
        ),
        ("memfd not sealed", aib.ProtocolError, message, [unsealed], True),
        ("memfd smaller than the region", aib.ProtocolError, message, [too_small], True),
        ("payload shorter than a lease id", aib.ProtocolError, b"", fds, False),
    ]
    replies: list[tuple[int, bytes, list[int]] | None] = []
    for lease_id, (_, _, body, item_fds, with_lease) in enumerate(cases, start=100):
        payload = encode_item(lease_id, body) if with_lease else b"\x01\x02\x03"
        replies.append((protocol.ITEM, payload, item_fds))
    replies.append((protocol.ITEM, encode_item(7, message), fds))  # finally a good one
    try:
        with FakePublisher(os.path.join(sock_dir, "fake.sock"), replies=replies) as fake:
            base_fds = fd_count()
            with aib.connect(fake.path, timeout=5.0) as session:
                base_fds = fd_count()
                for lease_id, (what, error, _, _, with_lease) in enumerate(cases, start=100):
                    with pytest.raises(error):
                        session.get("t")
                    assert fd_count() == base_fds, f"{what}: received fds were not closed"
                    if with_lease:
                        assert fake.releases.get(timeout=2.0) == lease_id, what
                    settle()
                    with pytest.raises(queue.Empty):
                        fake.releases.get(timeout=0.05)
                with session.get("t") as imported:
                    assert_arrays_equal(pa.table(imported), sample_table(300))
                settle()
                assert fake.releases.get(timeout=2.0) == 7
    finally:
        exported.close()
        for fd in (read_end, write_end, unsealed, too_small):
            os.close(fd)


def test_error_reply_with_bad_json_is_protocol_error(sock_dir: str) -> None:
    """An ERROR reply that is not JSON, or JSON of the wrong shape, raises ProtocolError; a well-formed
    one of an unknown type arrives as BridgeError with the publisher's message."""
    replies: list[tuple[int, bytes, list[int]] | None] = [
        (protocol.ERROR, b"\xff not json", []),
        (protocol.ERROR, b"[1, 2]", []),
        (protocol.ERROR, protocol.encode_json({"type": "Weird", "message": "boom"}), []),
        (protocol.NAMES, protocol.encode_json(["t"]), []),
    ]
    with (
        FakePublisher(os.path.join(sock_dir, "fake.sock"), replies=replies) as fake,
        aib.connect(fake.path, timeout=5.0) as session,
    ):
        with pytest.raises(aib.ProtocolError):
            session.get("t")
        with pytest.raises(aib.ProtocolError):
            session.get("t")
        with pytest.raises(aib.BridgeError, match="publisher: boom"):
            session.get("t")
        with pytest.raises(aib.ProtocolError, match="expected ITEM"):
            session.get("t")


def test_item_with_extra_fds_closes_them(sock_dir: str) -> None:
    """An ITEM that carries more descriptors than its message uses (here 100 extra) still imports; every
    received descriptor is closed once the import holds its mappings."""
    exported = aib.export(sample_table(300))
    junk = [os.memfd_create(f"junk{i}", os.MFD_CLOEXEC) for i in range(100)]
    try:
        item = (protocol.ITEM, encode_item(5, exported.message), [*exported.fds, *junk])
        with (
            FakePublisher(os.path.join(sock_dir, "fake.sock"), replies=[item]) as fake,
            aib.connect(fake.path, timeout=5.0) as session,
        ):
            base_fds = fd_count()
            with session.get("t") as imported:
                assert fd_count() == base_fds
                assert_arrays_equal(pa.table(imported), sample_table(300))
            settle()
            assert fake.releases.get(timeout=2.0) == 5
    finally:
        exported.close()
        for fd in junk:
            os.close(fd)


@pytest.mark.parametrize(
    "welcome",
    [
        pytest.param(b"\xffnot json", id="not-json"),
        pytest.param(b"[1, 2]", id="not-an-object"),
        pytest.param(b'{"protocol": 1}', id="no-wire-version"),
        pytest.param(b'{"protocol": 1, "wire": [99, 0]}', id="other-wire-major"),
    ],
)
def test_malformed_welcome_fails_connect(sock_dir: str, welcome: bytes) -> None:
    """``connect`` to a publisher whose WELCOME is not JSON, not an object, or announces another wire major
    version raises ProtocolError and closes its connection (no descriptor left open)."""
    with FakePublisher(os.path.join(sock_dir, "fake.sock"), welcome=welcome) as fake:
        base_fds = fd_count()
        with pytest.raises(aib.ProtocolError):
            aib.connect(fake.path, timeout=5.0)
        assert wait_for(lambda: fd_count() == base_fds, 2.0)  # the fake server's end closes on EOF


@pytest.mark.parametrize(
    "zero_copy",
    [
        pytest.param(False, id="copied-region"),
        pytest.param(True, id="zero-copy-region"),
    ],
)
def test_import_message_with_unusable_fd_raises_protocol_error(
    shm_file: tuple[str, pa.Table], zero_copy: bool
) -> None:
    """``import_message`` given a descriptor number that is not open raises ProtocolError (as
    documented: a region this process cannot map as described), whether the region is a copy or zero-copy, and
    leaks nothing (checked by the leak fixture). Regression test: the zero-copy case used to raise a bare
    OSError from the mapping cache's fstat."""
    path, _ = shm_file
    source = pa.ipc.open_file(pa.memory_map(path)).read_all() if zero_copy else sample_table(100)
    with aib.export(source, copy="never" if zero_copy else "always") as exported:
        assert exported.stats.zero_copy_regions == (1 if zero_copy else 0)
        not_open = 1_000_000  # far above any descriptor this process has open
        with aib.Session() as session, pytest.raises(aib.ProtocolError):
            session.import_message(exported.message, [not_open] * len(exported.fds))
    del source
