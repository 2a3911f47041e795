"""A live stream of frames: every batch the producer commits reaches the subscribed consumer, in
order, each under a lease of its own, with backpressure.

The producer opens the stream "frames" with reserved slots (``aib.SlotLayout``): it ``reserve``s a
slot, fills its NumPy columns in place (shared memory: nothing is copied to send it) and
``commit``s it. The last frame is built elsewhere and sent with ``write`` instead (one sealed copy).

The consumer ``subscribe``s with ``max_in_flight=4`` and is slow on purpose for its first frames.
Under the policy ``on_slow="block"`` the producer's commit waits for the consumer's credit: the
consumer never holds more than 4 unreleased frames, and none is lost. (``"drop_oldest"`` would drop
the oldest queued frame instead, ``"error"`` end the slow subscription.)

Run: ``python examples/live_stream.py``
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

import arrow_ipc_bridge as aib

FRAMES = 200
ROWS = 1024  # pixels per frame, say
IN_FLIGHT = 4
SLOW_FRAMES = 20  # the consumer takes 20 ms over each of its first frames
SCHEMA = pa.schema([("pixel", pa.float32()), ("frame", pa.int64())])


def consumer(path: str) -> None:
    """Subscribe to "frames", check each frame's contents and sequence, release it."""
    received = 0
    checksum = 0.0
    with (
        aib.connect(path, timeout=10.0) as session,
        session.subscribe("frames", max_in_flight=IN_FLIGHT) as live,
    ):
        for batch in live:  # ends when the producer closes the stream
            with batch:  # leaving the block releases the frame: credit back, slot free for reuse
                frame = pa.record_batch(batch)
                number = frame.column("frame")[0].as_py()
                if number != received or live.last_sequence != received:
                    raise RuntimeError(
                        f"frame {number} (sequence {live.last_sequence}) after {received} frames"
                    )
                checksum += float(np.asarray(frame.column("pixel")).sum())
                del frame  # pyarrow's view holds the frame too
                received += 1
                if received <= SLOW_FRAMES:
                    time.sleep(0.02)
        print(
            f"consumer: received {received} frames in order, {live.dropped} dropped, checksum {checksum:.0f}",
            flush=True,
        )


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "publisher.sock")
    ramp = np.arange(ROWS, dtype=np.float32)
    try:
        with aib.Publisher(path) as publisher:
            writer = publisher.open_stream(
                "frames",
                max_in_flight=IN_FLIGHT,
                on_slow="block",
                block_timeout=30.0,
                slots=aib.SlotLayout(SCHEMA, rows=ROWS),
            )
            child = multiprocessing.get_context("spawn").Process(target=consumer, args=(path,), daemon=True)
            child.start()
            # Late join is "from now on": wait for the subscriber before the first frame.
            deadline = time.monotonic() + 60
            while writer.subscribers == 0:
                if time.monotonic() > deadline or not child.is_alive():
                    raise RuntimeError("the consumer did not subscribe")
                time.sleep(0.01)

            started = time.monotonic()
            most_unreleased = 0
            for number in range(FRAMES - 1):
                slot = writer.reserve()  # waits for a free slot (its previous frame released)
                pixels, frame = slot.columns  # NumPy arrays over the slot's shared memory
                pixels[:] = ramp + number
                frame[:] = number
                slot.commit()  # waits for the consumer's credit (on_slow="block")
                most_unreleased = max(most_unreleased, writer.leases)
            last = FRAMES - 1
            writer.write(
                pa.record_batch([pa.array(ramp + last), pa.array(np.full(ROWS, last))], schema=SCHEMA)
            )
            writer.close()  # the consumer's iteration ends after the last frame
            elapsed = time.monotonic() - started
            print(
                f"producer: {writer.batches_written} frames in {elapsed:.2f} s, at most {most_unreleased} "
                f"unreleased at once (max_in_flight {IN_FLIGHT})",
                flush=True,
            )

            child.join(timeout=60)
            if child.is_alive():
                child.terminate()
                child.join()
            if child.exitcode != 0:
                print(f"producer: the consumer failed (exit code {child.exitcode})", file=sys.stderr)
                return 1
            expected = FRAMES * float(ramp.sum()) + ROWS * sum(range(FRAMES))
            print(f"producer: expected checksum {expected:.0f}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
