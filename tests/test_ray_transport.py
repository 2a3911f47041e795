"""The bridge as a Ray tensor transport (``arrow_ipc_bridge.integrations.ray``), on a real local Ray
cluster: two actors pass Arrow data through the transport and the tests check what arrived, where
its buffers lie, which route it took, and that Ray's free reaches the sender's publisher.

How "zero-copy" is checked: the receiving actor looks each buffer address up in its own
``/proc/self/maps``; a buffer handed over by the bridge lies in a read-only shared mapping of a
memfd. For a table the sender built in ``aib.allocate_shared`` memory (published with
``copy="never"``, so any copy would have raised) the receiver's mapping is of the same file
(inode) as the one under the sender's own buffers: the bytes were never copied on the way.

How "another node" is faked: the transport routes by the node each process runs on, which
``NODE_ID_ENV`` overrides (a documented option of the module): the receiving actor is started
with it set (``runtime_env`` env_vars), so to the transport it runs on another machine, and the
transfer must take the sender's Flight front, or fail with ``RouteError`` when there is none.
Nothing else is faked: both actors really are processes of the one local node.

Without ray installed every test here skips, except the one that checks the package imports
without it. GPU tests carry the ``gpu`` marker and run where there is a GPU (and CuPy).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import arrow_ipc_bridge as aib

ROWS = 10_000
TIMEOUT_S = 60  # one Ray round trip takes well under a second; generous for 2 busy cores


def test_the_package_imports_without_ray_and_the_integration_says_what_it_needs() -> None:
    """``import arrow_ipc_bridge`` (and its ``integrations`` package) never loads ray; the
    integration, without ray, raises an ImportError that names the extra to install. Run in a
    child, which then makes ``ray`` impossible to import."""
    code = textwrap.dedent(
        """
        import sys
        import arrow_ipc_bridge
        import arrow_ipc_bridge.integrations
        assert "ray" not in sys.modules, "importing the package loaded ray"
        sys.modules["ray"] = None  # import ray -> ImportError, as where it is not installed
        try:
            import arrow_ipc_bridge.integrations.ray
        except ImportError as exc:
            print("refused:", exc)
        else:
            raise SystemExit("imported without ray")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout
    assert "ray>=2.60" in result.stdout
    assert "arrow_ipc_bridge[ray]" in result.stdout


try:
    import ray

    from arrow_ipc_bridge.integrations import ray as aib_ray
except ImportError as exc:
    ray = aib_ray = None
    NO_RAY = f"the Ray transport tests need ray>=2.60 (pip install 'arrow_ipc_bridge[ray]'): {exc}"
else:
    NO_RAY = ""
    # Before the classes below: @ray.method checks the transport's name when it decorates.
    aib_ray.register()
    # The actor classes and helpers of this file travel to Ray's workers by value: the workers
    # cannot import a test module by its name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

needs_ray = pytest.mark.skipif(ray is None, reason=NO_RAY)


def _remote(**options: Any) -> Any:
    """``ray.remote(**options)``, or the class as it is where ray is missing (its tests skip)."""
    return ray.remote(**options) if ray is not None else (lambda cls: cls)


def _method(function: Any) -> Any:
    """A method whose return value crosses through the transport."""
    return ray.method(tensor_transport=aib_ray.TRANSPORT)(function) if ray is not None else function


# --- without a cluster ---------------------------------------------------------------------------------


@needs_ray
def test_payload_refuses_what_is_not_arrow_and_bad_copy_policies() -> None:
    with pytest.raises(aib.InvalidArgumentError, match="Arrow PyCapsule producer"):
        aib_ray.ArrowPayload([1, 2, 3])
    table = pa.table({"x": [1]})
    with pytest.raises(aib.InvalidArgumentError, match="copy must be one of") as info:
        aib_ray.ArrowPayload(table, copy="sometimes")
    assert info.value.argument == "copy"
    with pytest.raises(aib.InvalidArgumentError, match="copy must be one of"):
        aib_ray.ArrowPayload(table, copy=None)


@needs_ray
def test_payload_offers_only_the_protocol_methods_its_data_has() -> None:
    """Consumers probe with hasattr (pylibcudf tries the device array first): a payload must not
    claim a method its data lacks."""

    class DeviceOnly:
        device = "cuda:0"

        def __arrow_c_device_array__(self, requested_schema: object = None) -> None:
            raise AssertionError("not called")

    payload = aib_ray.ArrowPayload(DeviceOnly())
    assert hasattr(payload, "__arrow_c_device_array__")
    assert not hasattr(payload, "__arrow_c_stream__")
    assert not hasattr(payload, "__arrow_c_array__")
    batch = pa.record_batch({"x": pa.array([1, 2, 3])})
    assert pa.record_batch(aib_ray.ArrowPayload(batch)).equals(batch)


@needs_ray
def test_pickling_is_counted_and_refuses_device_data() -> None:
    """Pickling is Ray's object-store path, not the transport's: host data goes as pyarrow (a copy,
    counted in stats().pickled), device data is refused rather than copied to the host unasked."""
    import pickle

    table = pa.table({"x": pa.array(range(100))})
    before = aib_ray.stats().pickled
    copy = pickle.loads(pickle.dumps(aib_ray.ArrowPayload(table)))
    assert pa.table(copy).equals(table)
    assert aib_ray.stats().pickled == before + 1

    class DeviceOnly:
        device = "cuda:0"

        def __arrow_c_device_array__(self, requested_schema: object = None) -> None:
            raise AssertionError("not called")

    with pytest.raises(TypeError, match="device data cannot be pickled"):
        pickle.dumps(aib_ray.ArrowPayload(DeviceOnly()))


def _meta(**overrides: Any) -> Any:
    fields: dict[str, Any] = {
        "tensor_meta": [((), "Table")],
        "tensor_device": "cpu",
        "socket_path": "/tmp/x.sock",
        "names": ["ray/1/0"],
        "versions": [1],
        "node_id": "node-a",
        "boot_id": "boot-a",
        "hostname": "host-a",
    }
    fields.update(overrides)
    return aib_ray.BridgeTransportMetadata(**fields)


@needs_ray
def test_route_rules() -> None:
    route, why = aib_ray.choose_route(_meta(), "node-a", "boot-a")
    assert (route, why) == ("socket", "same Ray node")
    route, why = aib_ray.choose_route(_meta(), "node-b", "boot-a")
    assert route == "socket"
    assert "same boot id" in why
    route, why = aib_ray.choose_route(_meta(flight_location="grpc://10.0.0.1:9"), "node-b", "boot-b")
    assert route == "flight"
    assert "host-a" in why
    with pytest.raises(aib_ray.RouteError, match="serves no Flight front") as info:
        aib_ray.choose_route(_meta(), "node-b", "boot-b")
    assert (info.value.source_node, info.value.node) == ("node-a", "node-b")
    assert isinstance(info.value, aib.TransportError)


# --- on a local Ray cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    if ray is None:
        pytest.skip(NO_RAY)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _mapping_of(address: int) -> tuple[str, int, str] | None:
    """(permissions, inode, path) of this process's mapping holding ``address``, or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            low, high = (int(bound, 16) for bound in parts[0].split("-"))
            if low <= address < high:
                return parts[1], int(parts[4]), parts[5].strip() if len(parts) > 5 else ""
    return None


def _data_buffers(table: pa.Table) -> list[pa.Buffer]:
    return [chunk.buffers()[1] for column in table.columns for chunk in column.chunks]


def _shared_table(rows: int) -> tuple[pa.Table, Any]:
    """A table whose one column lies in ``allocate_shared`` memory (shareable with no copy)."""
    buffer = aib.allocate_shared(rows * 8, name="ray-test")
    np.frombuffer(buffer.view(), dtype=np.int64)[:] = np.arange(rows, dtype=np.int64)
    column = pa.Array.from_buffers(pa.int64(), rows, [None, buffer.as_pyarrow()])
    return pa.table({"x": column}), buffer


@_remote(enable_tensor_transport=True)
class Producer:
    def __init__(self, flight: bool = False) -> None:
        self.heap = pa.table(
            {"x": pa.array(np.arange(ROWS, dtype=np.int64)), "s": [str(i) for i in range(ROWS)]}
        )
        self.shared, self.shared_buffer = _shared_table(ROWS)
        if flight:
            aib_ray.serve_flight("grpc://127.0.0.1:0")

    @_method
    def heap_table(self) -> Any:
        return aib_ray.ArrowPayload(self.heap)

    @_method
    def shared_table(self) -> Any:
        return aib_ray.ArrowPayload(self.shared, copy="never")

    @_method
    def several(self) -> Any:
        batch = self.heap.to_batches()[0].slice(0, 100)
        return {
            "batch": aib_ray.ArrowPayload(batch),
            "array": aib_ray.ArrowPayload(self.heap["x"].chunk(0)),
            "n": 7,
        }

    @_method
    def bare_table(self) -> Any:
        return self.heap

    def shared_inodes(self) -> list[int]:
        inodes = []
        for buffer in _data_buffers(self.shared):
            mapping = _mapping_of(buffer.address)
            assert mapping is not None
            inodes.append(mapping[1])
        return inodes

    def publisher_state(self) -> tuple[list[str], int]:
        pub = aib_ray.local_publisher()
        return ([], 0) if pub is None else (pub.names(), pub.active_leases)

    def transport_stats(self) -> Any:
        return aib_ray.stats()

    def close_transport(self) -> None:
        aib_ray.close()

    def republish_everything(self) -> None:
        """Publish other data under every name in flight, as nothing of the transport does."""
        pub = aib_ray.local_publisher()
        assert pub is not None
        for name in pub.names():
            pub.publish(name, pa.table({"x": pa.array([0], pa.int64())}))

    def ping(self) -> int:
        return os.getpid()

    def socket_path(self) -> str:
        pub = aib_ray.local_publisher()
        assert pub is not None
        return str(pub.path)


@_remote(enable_tensor_transport=True)
class Consumer:
    def __init__(self) -> None:
        self.held: list[Any] = []

    def describe(self, payload: Any) -> dict[str, Any]:
        """What arrived: equality facts, the route, and where every data buffer lies."""
        self.held.append(payload)
        table = pa.table(payload)
        mappings = [_mapping_of(buffer.address) for buffer in _data_buffers(table) if buffer is not None]
        return {
            "rows": table.num_rows,
            "x_sum": pa.compute.sum(table["x"]).as_py(),
            "last_s": table["s"][-1].as_py() if "s" in table.column_names else None,
            "route": payload.route,
            "reason": payload.route_reason,
            "name": payload.name,
            "type": type(payload.data).__name__,
            "mappings": mappings,
            "record": aib_ray.transfers()[-1],
        }

    def several(self, value: dict[str, Any]) -> dict[str, Any]:
        self.held.append(value)
        return {
            "n": value["n"],
            "batch_rows": pa.record_batch(value["batch"]).num_rows,
            "array": pa.array(value["array"]).to_numpy()[:3].tolist(),
            "routes": [value["batch"].route, value["array"].route],
        }

    def count(self, *payloads: Any) -> int:
        self.held.extend(payloads)
        return sum(pa.table(payload).num_rows for payload in payloads)

    def reread(self) -> list[int]:
        """The sums of everything held, read again now."""
        return [pa.compute.sum(pa.table(payload)["x"]).as_py() for payload in self.held]

    def drop(self) -> None:
        self.held.clear()

    def transport_stats(self) -> Any:
        return aib_ray.stats()


def _wait_until(what: str, condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _settle(actor: Any) -> None:
    """Wait for the receive tasks Ray queued on ``actor``: they run in order on its ``_ray_system``
    concurrency group, so a no-op there runs after them. Killing an actor with one still queued makes
    Ray's transfer monitor (in the driver) abort it, and its abort path imports a module that needs
    torch: a thread exception in the driver where torch is missing, whichever test runs then."""
    with contextlib.suppress(ray.exceptions.RayActorError):
        ray.get(actor.__ray_call__.options(concurrency_group="_ray_system").remote(_no_op), timeout=TIMEOUT_S)


def _no_op(actor_self: Any) -> None:
    return None


def _kill(*actors: Any) -> None:
    for actor in actors:
        _settle(actor)
        ray.kill(actor, no_restart=True)


@pytest.fixture
def pair(cluster: None) -> Iterator[tuple[Any, Any]]:
    producer, consumer = Producer.remote(), Consumer.remote()
    try:
        yield producer, consumer
    finally:
        _kill(producer, consumer)


@needs_ray
def test_host_tables_arrive_equal_and_zero_copy_and_are_freed(pair: tuple[Any, Any]) -> None:
    producer, consumer = pair
    expected_sum = ROWS * (ROWS - 1) // 2

    shared_ref = producer.shared_table.remote()
    got = ray.get(consumer.describe.remote(shared_ref), timeout=TIMEOUT_S)
    assert (got["rows"], got["x_sum"]) == (ROWS, expected_sum)
    assert got["route"] == "socket"
    assert got["reason"] == "same Ray node"
    assert got["type"] == "ImportedHostStream"
    assert got["record"].route == "socket"
    assert got["record"].name == got["name"]
    # The receiver's buffer lies in a read-only shared mapping of the very file under the sender's.
    [mapping] = got["mappings"]
    assert mapping is not None
    permissions, inode, path = mapping
    assert permissions == "r--s"
    assert path.startswith("/memfd:")
    assert [inode] == ray.get(producer.shared_inodes.remote(), timeout=TIMEOUT_S)

    heap_ref = producer.heap_table.remote()
    got = ray.get(consumer.describe.remote(heap_ref), timeout=TIMEOUT_S)
    assert (got["rows"], got["x_sum"], got["last_s"]) == (ROWS, expected_sum, str(ROWS - 1))
    # A heap table is copied once, at publish, into a sealed memfd the receiver maps.
    for permissions, _inode, path in got["mappings"]:
        assert (permissions, path.startswith("/memfd:")) == ("r--s", True)
    sender = ray.get(producer.transport_stats.remote(), timeout=TIMEOUT_S)
    assert sender.published == 2
    assert sender.copied_bytes >= ROWS * 8  # the heap table's copy; the shared one added nothing
    receiver = ray.get(consumer.transport_stats.remote(), timeout=TIMEOUT_S)
    assert (receiver.received_socket, receiver.received_flight, receiver.receive_errors) == (2, 0, 0)

    # Published while the refs live; the receiver's leases hold the data after Ray freed the names.
    names, leases = ray.get(producer.publisher_state.remote(), timeout=TIMEOUT_S)
    assert len(names) == 2
    assert leases == 2
    del shared_ref, heap_ref
    _wait_until("Ray's free to unpublish", lambda: ray.get(producer.publisher_state.remote())[0] == [])
    assert ray.get(producer.publisher_state.remote(), timeout=TIMEOUT_S)[1] == 2
    assert ray.get(consumer.reread.remote(), timeout=TIMEOUT_S) == [expected_sum, expected_sum]
    ray.get(consumer.drop.remote(), timeout=TIMEOUT_S)
    _wait_until("the receiver's leases to end", lambda: ray.get(producer.publisher_state.remote())[1] == 0)
    assert ray.get(producer.transport_stats.remote(), timeout=TIMEOUT_S).freed == 2


@needs_ray
def test_the_driver_and_nested_values_and_kinds(pair: tuple[Any, Any]) -> None:
    producer, consumer = pair
    # ray.get in the driver receives through the transport too.
    ref = producer.heap_table.remote()
    payload = ray.get(ref, timeout=TIMEOUT_S)
    assert isinstance(payload, aib_ray.ArrowPayload)
    assert payload.route == "socket"
    table = pa.table(payload)
    assert table["x"].to_pylist()[:3] == [0, 1, 2]
    mapping = _mapping_of(table["x"].chunk(0).buffers()[1].address)
    assert mapping is not None
    assert mapping[0] == "r--s"
    del table
    payload.release()
    # ray.put in the driver sends through the transport too: the driver publishes, Ray's free
    # unpublishes there.
    put_ref = ray.put(
        aib_ray.ArrowPayload(pa.table({"x": pa.array([5, 6, 7], pa.int64())})),
        _tensor_transport=aib_ray.TRANSPORT,
    )
    assert ray.get(consumer.count.remote(put_ref), timeout=TIMEOUT_S) == 3
    driver_publisher = aib_ray.local_publisher()
    assert driver_publisher is not None
    assert len(driver_publisher.names()) == 1
    del put_ref
    ray.get(consumer.drop.remote(), timeout=TIMEOUT_S)
    _wait_until(
        "the driver's put to be freed",
        lambda: (driver_publisher.names(), driver_publisher.active_leases) == ([], 0),
    )
    # Payloads anywhere in the value (a dict here) travel; other values beside them as usual.
    got = ray.get(consumer.several.remote(producer.several.remote()), timeout=TIMEOUT_S)
    assert got == {"n": 7, "batch_rows": 100, "array": [0, 1, 2], "routes": ["socket", "socket"]}


@needs_ray
def test_a_method_returning_no_payload_fails_instead_of_using_the_object_store(pair: tuple[Any, Any]) -> None:
    producer, _ = pair
    # Got in the driver: a consumer task given the failed ref would leave a receive task on it
    # that Ray's failure monitor aborts when the actor is killed, through an import of its
    # collective module that needs torch (a Ray matter, not the transport's).
    with pytest.raises(ray.exceptions.RayTaskError, match="returned no ArrowPayload"):
        ray.get(producer.bare_table.remote(), timeout=TIMEOUT_S)


@needs_ray
def test_the_object_store_path_is_rays_own_and_counted(pair: tuple[Any, Any]) -> None:
    """``ray.get(ref, _use_object_store=True)`` asks Ray for its own path: the payload is pickled
    (a copy), the receiver gets a plain pyarrow table, and the sender counts it."""
    producer, _ = pair
    ref = producer.heap_table.remote()
    payload = ray.get(ref, timeout=TIMEOUT_S, _use_object_store=True)
    assert payload.route is None
    assert isinstance(payload.data, pa.Table)
    assert payload.data["s"][-1].as_py() == str(ROWS - 1)
    assert ray.get(producer.transport_stats.remote(), timeout=TIMEOUT_S).pickled == 1


@needs_ray
def test_many_objects_in_flight_are_all_received_and_all_freed(pair: tuple[Any, Any]) -> None:
    producer, consumer = pair
    refs = [producer.heap_table.remote() for _ in range(200)]
    assert ray.get(consumer.count.remote(*refs), timeout=TIMEOUT_S * 3) == 200 * ROWS
    names, leases = ray.get(producer.publisher_state.remote(), timeout=TIMEOUT_S)
    assert (len(names), leases) == (200, 200)
    del refs
    ray.get(consumer.drop.remote(), timeout=TIMEOUT_S)
    _wait_until(
        "all 200 to be freed", lambda: ray.get(producer.publisher_state.remote()) == ([], 0), timeout=60
    )
    sender = ray.get(producer.transport_stats.remote(), timeout=TIMEOUT_S)
    assert (sender.published, sender.freed, sender.live) == (200, 200, 0)


@needs_ray
def test_a_killed_sender_leaves_held_data_valid_and_later_receives_fail(
    pair: tuple[Any, Any],
) -> None:
    producer, consumer = pair
    expected_sum = ROWS * (ROWS - 1) // 2
    held, not_yet = producer.heap_table.remote(), producer.heap_table.remote()
    assert ray.get(consumer.describe.remote(held), timeout=TIMEOUT_S)["x_sum"] == expected_sum
    killed_directory = os.path.dirname(ray.get(producer.socket_path.remote(), timeout=TIMEOUT_S))
    pid = ray.get(producer.ping.remote(), timeout=TIMEOUT_S)
    _kill(producer)  # asynchronous: the actor is marked dead, and its process ends, a little later
    _wait_until("the killed sender's process to exit", lambda: not os.path.exists(f"/proc/{pid}"))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(producer.ping.remote(), timeout=TIMEOUT_S)
    # The held table lives in the receiver's mapping of the sender's memfd, which outlives it.
    assert ray.get(consumer.reread.remote(), timeout=TIMEOUT_S) == [expected_sum]
    started = time.monotonic()
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(consumer.describe.remote(not_yet), timeout=TIMEOUT_S)
    assert isinstance(info.value.cause, aib_ray.SourceGoneError)
    assert "was killed" in str(info.value.cause)  # of the cached session, or a new connect
    assert time.monotonic() - started < 30  # a clear error at once, not Ray's transfer timeout
    # The receiver goes on: a new sender's data arrives. That sender, starting its publisher, removed
    # the killed one's socket directory (its process is gone; killed, it could not remove it).
    assert os.path.isdir(killed_directory)
    other = Producer.remote()
    try:
        assert ray.get(consumer.describe.remote(other.heap_table.remote()), timeout=TIMEOUT_S)["rows"] == ROWS
        assert not os.path.exists(killed_directory)
    finally:
        _kill(other)


@needs_ray
def test_a_closed_publisher_before_the_receive_is_a_clear_error(pair: tuple[Any, Any]) -> None:
    producer, consumer = pair
    ref = producer.heap_table.remote()
    ray.get(consumer.describe.remote(producer.heap_table.remote()), timeout=TIMEOUT_S)  # a session to it
    ray.get(producer.close_transport.remote(), timeout=TIMEOUT_S)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(consumer.describe.remote(ref), timeout=TIMEOUT_S)
    assert isinstance(info.value.cause, aib_ray.SourceGoneError)
    assert "closed or died before the receive" in str(info.value.cause)
    # The sender's next send makes a new publisher, and the receiver reaches it.
    got = ray.get(consumer.describe.remote(producer.heap_table.remote()), timeout=TIMEOUT_S)
    assert (got["rows"], got["route"]) == (ROWS, "socket")


@needs_ray
def test_a_receiver_gets_the_very_publication_sent_or_an_error(pair: tuple[Any, Any]) -> None:
    """The receiver checks the publisher id and version of what it got against the metadata: a name
    published again meanwhile (another publication under it) is refused, not handed over."""
    producer, consumer = pair
    ref = producer.heap_table.remote()
    ray.get(producer.republish_everything.remote(), timeout=TIMEOUT_S)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(consumer.describe.remote(ref), timeout=TIMEOUT_S)
    assert isinstance(info.value.cause, aib_ray.SourceGoneError)
    assert "published again" in str(info.value.cause)


@needs_ray
def test_another_node_takes_the_flight_front_or_fails_clearly(cluster: None) -> None:
    pytest.importorskip("pyarrow.flight", reason="the Flight route needs pyarrow built with Flight")
    elsewhere = {"env_vars": {aib_ray.NODE_ID_ENV: "pretend-other-node"}}
    with_front, without_front = Producer.remote(flight=True), Producer.remote()
    consumer = Consumer.options(runtime_env=elsewhere).remote()
    try:
        later = with_front.heap_table.remote()
        got = ray.get(consumer.describe.remote(with_front.heap_table.remote()), timeout=TIMEOUT_S)
        assert got["route"] == "flight"
        assert "another machine" in got["reason"]
        assert got["record"].route == "flight"
        assert got["record"].node == "pretend-other-node"
        assert (got["rows"], got["last_s"]) == (ROWS, str(ROWS - 1))
        assert ray.get(consumer.transport_stats.remote(), timeout=TIMEOUT_S).received_flight == 1

        # The sender's front gone before a receive: a clear error, as on the socket route.
        ray.get(with_front.close_transport.remote(), timeout=TIMEOUT_S)
        with pytest.raises(ray.exceptions.RayTaskError) as gone:
            ray.get(consumer.describe.remote(later), timeout=TIMEOUT_S)
        assert isinstance(gone.value.cause, aib_ray.SourceGoneError)
        assert "Flight front" in str(gone.value.cause)

        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(consumer.describe.remote(without_front.heap_table.remote()), timeout=TIMEOUT_S)
        assert isinstance(info.value.cause, aib_ray.RouteError)
        assert "serves no Flight front" in str(info.value.cause)
    finally:
        _kill(with_front, without_front, consumer)


# --- GPU --------------------------------------------------------------------------------------------------


@_remote(enable_tensor_transport=True)
class GpuProducer:
    def __init__(self, rows: int) -> None:
        import cupy

        self.columns = {f"c{i}": cupy.arange(rows, dtype=cupy.float32) * (i + 1) for i in range(4)}
        cupy.cuda.get_current_stream().synchronize()

    @_method
    def columns_payload(self) -> Any:
        return aib_ray.ArrowPayload(aib.from_cuda_arrays(self.columns))

    @_method
    def uploaded_table(self) -> Any:
        table = pa.table({"x": pa.array(np.arange(1000, dtype=np.int64))})
        return aib_ray.ArrowPayload(aib.to_device(table))

    def publisher_state(self) -> tuple[list[str], int]:
        pub = aib_ray.local_publisher()
        return ([], 0) if pub is None else (pub.names(), pub.active_leases)


@_remote(enable_tensor_transport=True)
class CudfProducer:
    @_method
    def table(self) -> Any:
        import pylibcudf as plc

        return aib_ray.ArrowPayload(
            plc.Table.from_arrow(pa.table({"x": pa.array(np.arange(1000, dtype=np.int64))}))
        )


@_remote(enable_tensor_transport=True)
class GpuConsumer:
    def sums(self, payload: Any) -> dict[str, Any]:
        arrays = aib.column_arrays(payload.data, "cupy")
        result = {name: float(array.sum()) for name, array in arrays.items()}
        return {"sums": result, "route": payload.route, "device": payload.data.device}

    def cudf_sum(self, payload: Any) -> dict[str, Any]:
        import pylibcudf as plc

        table = plc.Table.from_arrow(payload)  # the payload offers the device capsule of its import
        total = plc.reduce.reduce(table.columns()[0], plc.aggregation.sum(), plc.DataType(plc.TypeId.INT64))
        value = total.to_py() if hasattr(total, "to_py") else plc.interop.to_arrow(total).as_py()
        return {"x": value, "rows": table.num_rows(), "route": payload.route, "device": payload.data.device}

    def torch_sum(self, payload: Any) -> dict[str, Any]:
        tensors = aib.column_arrays(payload.data, "torch")
        return {
            "x": int(tensors["x"].sum().item()),
            "device": str(tensors["x"].device),
            "route": payload.route,
        }


@needs_ray
@pytest.mark.gpu
def test_gpu_columns_cross_through_the_transport(cluster: None, cuda_device: int) -> None:
    pytest.importorskip("cupy", reason="the GPU producer needs cupy (pip install arrow_ipc_bridge[cuda12])")
    if not ray.cluster_resources().get("GPU"):
        pytest.skip("the local Ray cluster sees no GPU")
    rows = 1 << 20
    producer = GpuProducer.options(num_gpus=0.5).remote(rows)
    consumer = GpuConsumer.options(num_gpus=0.5).remote()
    try:
        got = ray.get(consumer.sums.remote(producer.columns_payload.remote()), timeout=TIMEOUT_S)
        assert got["route"] == "socket"
        assert got["device"].startswith("cuda:")
        base = float(np.arange(rows, dtype=np.float32).sum(dtype=np.float64))
        for i in range(4):
            assert got["sums"][f"c{i}"] == pytest.approx(base * (i + 1), rel=1e-5)
        _wait_until("Ray's free to unpublish", lambda: ray.get(producer.publisher_state.remote()) == ([], 0))
    finally:
        _kill(producer, consumer)


@needs_ray
@pytest.mark.gpu
def test_gpu_table_to_torch_through_the_transport(cluster: None, cuda_device: int) -> None:
    pytest.importorskip("cupy", reason="the GPU producer needs cupy (pip install arrow_ipc_bridge[cuda12])")
    pytest.importorskip("torch", reason="the consumer reads the column with torch")
    if not ray.cluster_resources().get("GPU"):
        pytest.skip("the local Ray cluster sees no GPU")
    producer = GpuProducer.options(num_gpus=0.5).remote(16)
    consumer = GpuConsumer.options(num_gpus=0.5).remote()
    try:
        got = ray.get(consumer.torch_sum.remote(producer.uploaded_table.remote()), timeout=TIMEOUT_S)
        assert got == {"x": 999 * 1000 // 2, "device": got["device"], "route": "socket"}
        assert got["device"].startswith("cuda")
    finally:
        _kill(producer, consumer)


@needs_ray
@pytest.mark.gpu
def test_pylibcudf_table_through_the_transport(cluster: None, cuda_device: int) -> None:
    plc = pytest.importorskip("pylibcudf", reason="the cuDF case needs pylibcudf (RAPIDS)")
    if not hasattr(plc.Table, "__arrow_c_device_array__"):
        pytest.skip(
            "this pylibcudf's Table offers no Arrow device capsule (__arrow_c_device_array__) to publish"
        )
    if not ray.cluster_resources().get("GPU"):
        pytest.skip("the local Ray cluster sees no GPU")
    producer = CudfProducer.options(num_gpus=0.5).remote()
    consumer = GpuConsumer.options(num_gpus=0.5).remote()
    try:
        got = ray.get(consumer.cudf_sum.remote(producer.table.remote()), timeout=TIMEOUT_S)
        assert (got["x"], got["rows"], got["route"]) == (999 * 1000 // 2, 1000, "socket")
        assert got["device"].startswith("cuda:")
    finally:
        _kill(producer, consumer)
