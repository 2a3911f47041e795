"""Arrow tables between Ray actors through the bridge: the transport ``ARROW_IPC_BRIDGE``.

A producer actor returns pyarrow tables from a method marked with the bridge's transport; a
consumer actor receives them as ``ArrowPayload`` objects over the producer's own memory, mapped
read-only: nothing is copied through Ray's object store. Two tables:

- "prices": built in ``aib.allocate_shared`` memory and sent with ``copy="never"``: the consumer
  reads the very pages the producer wrote (no copy at all);
- "trades": an ordinary pyarrow table on the heap, copied once, when it is published, into a sealed
  memfd (the default ``copy="if_needed"``, counted in the producer's ``stats().copied_bytes``).

The script starts a local Ray cluster of its own, prints what each side did and which route each
transfer took, and checks that Ray's free of the references unpublished both tables.

    python examples/ray_transport.py

Needs ray>=2.60 (``pip install 'arrow_ipc_bridge[ray]'``) and numpy.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

import arrow_ipc_bridge as aib
from arrow_ipc_bridge.integrations import ray as aib_ray

ROWS = 1_000_000

# First of all, in the driver: Ray checks a transport's name when @ray.method names it, and hands
# the registration to every actor it starts afterwards.
aib_ray.register()


@ray.remote(enable_tensor_transport=True)
class Producer:
    def __init__(self) -> None:
        self.buffer = aib.allocate_shared(ROWS * 8, name="prices")
        np.frombuffer(self.buffer.view(), dtype=np.float64)[:] = np.arange(ROWS) * 0.5
        self.prices = pa.table(
            {"price": pa.Array.from_buffers(pa.float64(), ROWS, [None, self.buffer.as_pyarrow()])}
        )
        self.trades = pa.table(
            {"qty": pa.array(np.arange(ROWS) % 100), "side": ["buy", "sell"] * (ROWS // 2)}
        )

    @ray.method(tensor_transport=aib_ray.TRANSPORT)
    def prices_table(self) -> aib_ray.ArrowPayload:
        return aib_ray.ArrowPayload(self.prices, copy="never")  # shared memory: refused if a copy were needed

    @ray.method(tensor_transport=aib_ray.TRANSPORT)
    def trades_table(self) -> aib_ray.ArrowPayload:
        return aib_ray.ArrowPayload(self.trades)  # heap memory: copied once, at publish

    def published(self) -> tuple[list[str], int, int]:
        pub = aib_ray.local_publisher()
        assert pub is not None
        return pub.names(), pub.active_leases, aib_ray.stats().copied_bytes

    def close(self) -> None:
        aib_ray.close()  # stop serving; removes the publisher's socket directory


@ray.remote(enable_tensor_transport=True)  # receivers need it too: Ray runs the receive on its thread
class Consumer:
    def summary(self, prices: aib_ray.ArrowPayload, trades: aib_ray.ArrowPayload) -> dict[str, object]:
        allocated = pa.total_allocated_bytes()
        price_table, trade_table = pa.table(prices), pa.table(trades)
        allocated = pa.total_allocated_bytes() - allocated  # 0: the tables lie in the producer's memory
        result = {
            "mean price": pc.mean(price_table["price"]).as_py(),
            "buy qty": pc.sum(trade_table.filter(pc.equal(trade_table["side"], "buy"))["qty"]).as_py(),
            "routes": [(payload.name, payload.route, payload.route_reason) for payload in (prices, trades)],
            "pyarrow allocated for the tables": allocated,
        }
        del price_table, trade_table
        prices.release()  # give the leases back now (otherwise when the payloads are collected)
        trades.release()
        return result


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        producer, consumer = Producer.remote(), Consumer.remote()
        prices = producer.prices_table.remote()
        names, _, copied = ray.get(producer.published.remote())
        print(f"producer: prices published as {names[0]}, {copied} bytes copied")
        assert copied == 0  # it lies in shared memory (copy="never" would have raised otherwise)
        trades = producer.trades_table.remote()
        names, _, copied = ray.get(producer.published.remote())
        print(f"producer: trades published too, {copied} bytes copied at publish (the heap table, once)")
        assert len(names) == 2
        assert copied >= ROWS * 8  # at least the qty column (int64)

        got = ray.get(consumer.summary.remote(prices, trades))
        for name, route, why in got["routes"]:
            print(f"consumer: {name} arrived by {route} ({why})")
        print(f"consumer: mean price {got['mean price']}, buy qty {got['buy qty']}")
        print(f"consumer: pyarrow allocated {got['pyarrow allocated for the tables']} bytes for both tables")
        assert got["mean price"] == (ROWS - 1) * 0.5 / 2
        assert got["buy qty"] == sum(i % 100 for i in range(0, ROWS, 2))
        assert got["pyarrow allocated for the tables"] == 0  # the consumer copied nothing
        assert all(route == "socket" for _, route, _ in got["routes"])

        del prices, trades  # Ray frees the objects, and the transport unpublishes them
        deadline = time.monotonic() + 30
        while ray.get(producer.published.remote())[:2] != ([], 0):
            assert time.monotonic() < deadline, "Ray's free did not reach the producer"
            time.sleep(0.1)
        print("producer: both unpublished after the refs went, no lease left")
        ray.get(producer.close.remote())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
