"""Which Arrow PyCapsule methods imported data offers: host data the host methods, device (CUDA)
data none of them (absent, so that a consumer probing with ``hasattr``, as pylibcudf's
``Table.from_arrow`` does, never takes a host method that could only refuse), and a device table its
one batch as ``__arrow_c_device_array__`` (several batches: a clear error and ``batch(i)`` for each).

No GPU needed: CUDA imports come from the C core's new-message path over handles put in the
process's region table (tests/test_new_message_import.py's helpers; nothing is dereferenced), and
relabelled host imports (``imported_from``). The GPU side, with pylibcudf and cuDF: tests/test_cudf.py.

Every test runs under the ``no_leaks`` fixture (tests/conftest.py).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from helpers.counting import SessionCounts
from helpers.session_rig import wait_for
from test_new_message_import import _cuda_shaped_message, _open_in_region_table, _publish_raw

import arrow_ipc_bridge as aib
from arrow_ipc_bridge._ffi import ffi
from arrow_ipc_bridge.consumer.imported import (
    ImportedBatch,
    ImportedDeviceArray,
    ImportedDeviceStream,
    ImportedHostArray,
    ImportedHostStream,
    imported_from,
)
from arrow_ipc_bridge.wire.capsules import DEVICE_CUDA, CapturedData, capsule_struct, capture
from arrow_ipc_bridge.wire.metadata import Decoded

pytestmark = pytest.mark.usefixtures("no_leaks")

HOST_METHODS = ("__arrow_c_array__", "__arrow_c_stream__")
DEVICE_METHODS = ("__arrow_c_device_array__", "__arrow_c_device_stream__")


def _offered(obj: object) -> set[str]:
    return {m for m in (*HOST_METHODS, *DEVICE_METHODS, "__arrow_c_schema__") if hasattr(obj, m)}


def _column_address(device_array: Any) -> int:
    """The data buffer's address of the first column of a device record batch."""
    return int(ffi.cast("uintptr_t", device_array.array.children[0].buffers[1]))


def _float_table(batches: int) -> pa.Table:
    return pa.Table.from_batches(
        [pa.record_batch({"x": pa.array([float(b)] * 4, pa.float64())}) for b in range(batches)]
    )


def test_host_imports_offer_the_host_methods(publisher: aib.Publisher) -> None:
    """Host data, first get and remembered gets alike: a record batch offers every method, a table
    the streams only (polars then takes the stream) and no device array."""
    counts = SessionCounts()
    batch = pa.record_batch({"x": pa.array([1, 2, 3])})
    table = pa.Table.from_batches([batch, batch])
    publisher.publish("b", batch)
    publisher.publish("t", table)
    with aib.connect(publisher.path, timeout=5.0) as session:
        for _ in range(3):
            with session.get("b") as imported:
                assert type(imported) is ImportedHostArray
                assert isinstance(imported, aib.ImportedArray)
                assert _offered(imported) == {*HOST_METHODS, *DEVICE_METHODS, "__arrow_c_schema__"}
                assert pa.record_batch(imported).equals(batch)
            with session.get("t") as imported:
                assert type(imported) is ImportedHostStream
                assert isinstance(imported, aib.ImportedStream)
                streams = {"__arrow_c_stream__", "__arrow_c_device_stream__", "__arrow_c_schema__"}
                assert _offered(imported) == streams
                assert pa.table(imported).equals(table)
                # Each batch on its own (zero copy), through the device array of the CPU.
                second = imported.batch(1)
                assert isinstance(second, ImportedBatch)
                assert pa.record_batch(second).equals(batch)
                del second
        assert counts.remembered_gets > 0
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_device_imports_have_no_host_methods(publisher: aib.Publisher) -> None:
    """CUDA data, imported by the C core (first get), remembered (after a second get of the same
    message) and rebuilt from the remembered template: no host method at all, the device ones
    present; the kinds stay ImportedArray / ImportedStream."""
    counts = SessionCounts()
    batch = pa.record_batch({f"c{i}": pa.array([float(i)] * 8, pa.float32()) for i in range(2)})
    table = _float_table(1)
    uuid, sync = bytes(range(16)), bytes(range(64))
    batch_handles = [bytes([0x10 + i]) * 64 for i in range(2)]
    table_handles = [bytes([0x20]) * 64]
    _publish_raw(publisher, "b", _cuda_shaped_message(batch, batch_handles, uuid, sync))
    _publish_raw(publisher, "t", _cuda_shaped_message(table, table_handles, uuid, sync))
    opened = [(h, 0x100000 * (i + 1)) for i, h in enumerate(batch_handles + table_handles)]
    try:
        with (
            _open_in_region_table(uuid, 0, sync, 0x77, opened),
            aib.connect(publisher.path, timeout=5.0) as session,
        ):
            for _ in range(4):
                with session.get("b") as imported:
                    assert type(imported) is ImportedDeviceArray
                    assert isinstance(imported, aib.ImportedArray)
                    assert _offered(imported) == {*DEVICE_METHODS, "__arrow_c_schema__"}
                with session.get("t") as imported:
                    assert type(imported) is ImportedDeviceStream
                    assert isinstance(imported, aib.ImportedStream)
                    assert _offered(imported) == {*DEVICE_METHODS, "__arrow_c_schema__"}
            assert counts.new_message_gets >= 2
            assert counts.remembered_gets >= 2
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        publisher.unpublish("b")
        publisher.unpublish("t")


def test_imported_from_chooses_by_device(publisher: aib.Publisher) -> None:
    """Every import made in Python (region imports, copies, to_device) goes through imported_from:
    the same message labelled CUDA gets the device classes, labelled CPU the host ones."""
    publisher.publish("b", pa.record_batch({"x": [1, 2]}))
    publisher.publish("t", pa.table({"x": [1, 2]}))
    with aib.connect(publisher.path, timeout=5.0) as session:
        for name, host_type, device_type in (
            ("b", ImportedHostArray, ImportedDeviceArray),
            ("t", ImportedHostStream, ImportedDeviceStream),
        ):
            with session.get(name) as imported:
                for label, expected in ((imported.device_type, host_type), (DEVICE_CUDA, device_type)):
                    again = imported_from(
                        Decoded.sharing(imported._decoded), imported._bases, device_type=label, device_id=0
                    )
                    try:
                        assert type(again) is expected
                        assert bool(set(HOST_METHODS) & _offered(again)) == (expected is host_type)
                    finally:
                        again.release()
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)


def test_a_one_batch_device_table_is_its_batch_as_a_device_array(publisher: aib.Publisher) -> None:
    """What pylibcudf's Table.from_arrow takes first: the table's one batch as it is (the column's
    pointer is the region's own, device CUDA, the GPU's ordinal). Captured again (republished), the
    table stays a stream of one batch."""
    handles = [bytes([0x31]) * 64]
    uuid, sync = bytes(range(1, 17)), bytes(range(2, 66))
    _publish_raw(publisher, "one", _cuda_shaped_message(_float_table(1), handles, uuid, sync))
    try:
        with (
            _open_in_region_table(uuid, 1, sync, 0x55, [(handles[0], 0x300000)]),
            aib.connect(publisher.path, timeout=5.0) as session,
            session.get("one") as imported,
        ):
            schema, array = imported.__arrow_c_device_array__()
            device_array = capsule_struct(array, "device_array")
            assert (device_array.device_type, device_array.device_id) == (DEVICE_CUDA, 1)
            assert device_array.array.length == 4
            assert _column_address(device_array) == 0x300000
            assert pa.Schema._import_from_c_capsule(schema) == _float_table(1).schema
            del device_array, array, schema
            captured = capture(imported)
            try:
                assert captured.is_stream
                assert len(captured.arrays) == 1
            finally:
                captured.close()
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        publisher.unpublish("one")


def test_a_device_table_of_several_batches_names_them_and_hands_each_over(publisher: aib.Publisher) -> None:
    """Several batches: __arrow_c_device_array__ refuses (one array of them would be a copy),
    naming the count and how to take each; batch(i) hands batch i over as it is; out-of-range and
    non-int indexes are refused; a released table refuses its batches too."""
    handles = [bytes([0x40 + i]) * 64 for i in range(3)]
    uuid, sync = bytes(range(3, 19)), bytes(range(4, 68))
    _publish_raw(publisher, "three", _cuda_shaped_message(_float_table(3), handles, uuid, sync))
    bases = [(handle, 0x400000 * (i + 1)) for i, handle in enumerate(handles)]
    try:
        with (
            _open_in_region_table(uuid, 0, sync, 0x66, bases),
            aib.connect(publisher.path, timeout=5.0) as session,
        ):
            imported = session.get("three")
            expected = r"table of 3 batches on cuda:0.*imported\.batch\(i\)"
            with pytest.raises(aib.BridgeError, match=expected) as err:
                imported.__arrow_c_device_array__()
            assert err.value.batch_count == 3  # type: ignore[attr-defined]
            for i in range(3):
                _, array = imported.batch(i).__arrow_c_device_array__()
                device_array = capsule_struct(array, "device_array")
                assert device_array.device_type == DEVICE_CUDA
                assert _column_address(device_array) == 0x400000 * (i + 1)
                del device_array, array
            with pytest.raises(aib.InvalidArgumentError, match="from 0 to 2"):
                imported.batch(3)
            with pytest.raises(aib.InvalidArgumentError):
                imported.batch("0")  # type: ignore[arg-type]
            first = imported.batch(0)
            captured = capture(imported)  # republishing keeps the three batches
            try:
                assert captured.is_stream
                assert len(captured.arrays) == 3
            finally:
                captured.close()
            imported.release()
            with pytest.raises(aib.ClosedError) as raised:
                first.__arrow_c_device_array__()
            assert raised.value.reason == "released"
            with pytest.raises(aib.ClosedError) as raised:
                imported.batch(0)
            assert raised.value.reason == "released"
        assert wait_for(lambda: publisher.active_leases == 0, 5.0)
    finally:
        publisher.unpublish("three")


def test_a_device_table_is_pumped_through_its_device_stream(publisher: aib.Publisher) -> None:
    """publish_stream of a GPU table (``aib.to_device(table)``) reads it through its device stream,
    batch by batch, device and pointers kept: it offers no host stream for the pump's pyarrow
    reader to take (which could only refuse device data, failing the stream)."""
    from arrow_ipc_bridge.producer.stream_writer import batches_of

    table = _float_table(3)
    publisher.publish("t", table)
    with aib.connect(publisher.path, timeout=5.0) as session, session.get("t") as imported:
        device = imported_from(
            Decoded.sharing(imported._decoded), imported._bases, device_type=DEVICE_CUDA, device_id=0
        )
        try:
            batches = list(batches_of(device))
            try:
                assert len(batches) == 3
                for i, captured in enumerate(batches):
                    assert isinstance(captured, CapturedData)
                    assert captured.device_type == DEVICE_CUDA
                    # the same memory as batch i of the host import (nothing copied)
                    host = capture(imported.batch(i))
                    try:
                        assert _column_address(captured.arrays[0]) == _column_address(host.arrays[0])
                    finally:
                        host.close()
            finally:
                for captured in batches:
                    captured.close()  # type: ignore[union-attr]
        finally:
            device.release()
    assert wait_for(lambda: publisher.active_leases == 0, 5.0)
