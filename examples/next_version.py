"""Waiting for the next version of a name: a trainer publishes "weights" every step, an evaluator
follows along without polling.

The consumer starts first: ``aib.connect(..., wait_for_publisher=True)`` waits for the socket,
``session.get("weights", wait=...)`` for the name, and ``session.get_next("weights", after=version,
timeout=...)`` for each newer version. The publisher holds each wait open and answers as soon as
it can (one WAIT frame, no polling); versions published while the consumer was busy are skipped,
so a slow consumer always gets the newest one.

Run: ``python examples/next_version.py``
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

STEPS = 30
PARAMETERS = 4096


def weights(step: int) -> pa.RecordBatch:
    """The model at ``step``: every parameter equals the step, so the consumer can check it."""
    return pa.record_batch(
        {"w": np.full(PARAMETERS, step, dtype=np.float32), "step": np.full(PARAMETERS, step)}
    )


def evaluator(path: str) -> None:
    """Follow "weights" to the last step, checking each version got."""
    print("consumer: waiting for the publisher", flush=True)
    seen: list[int] = []
    with aib.connect(path, timeout=10.0, wait_for_publisher=True) as session:
        item = session.get("weights", wait=30.0)  # waits until the name is published
        while True:
            with item:
                batch = pa.record_batch(item)
                step = batch.column("step")[0].as_py()
                if not np.all(np.asarray(batch.column("w")) == step):
                    raise RuntimeError(f"version {item.version} mixes steps")
                version = item.version  # set on objects got by waiting (None after a plain get)
                if version is None:
                    raise RuntimeError("a waited-for object has no version")
                del batch
            seen.append(step)
            if step == STEPS - 1:
                break
            time.sleep(0.05 if len(seen) % 3 == 0 else 0.0)  # busy now and then: versions get skipped
            # the publisher answers once it has a version newer than `version`
            item = session.get_next("weights", after=version, timeout=30.0)
    skipped = STEPS - len(seen)
    print(
        f"consumer: got {len(seen)} versions, steps increasing: {seen == sorted(set(seen))}, "
        f"last step {seen[-1]}, {skipped} skipped while busy",
        flush=True,
    )


def main() -> int:
    directory = tempfile.mkdtemp(prefix="aib-example-")
    path = os.path.join(directory, "publisher.sock")
    child = multiprocessing.get_context("spawn").Process(target=evaluator, args=(path,), daemon=True)
    child.start()  # before the publisher exists
    try:
        time.sleep(0.5)  # the trainer takes a while to start
        with aib.Publisher(path) as publisher:
            for step in range(STEPS):
                publisher.publish("weights", weights(step))  # a new version each time
                time.sleep(0.02)  # a training step
            print(
                f"producer: published {STEPS} versions, the last is {publisher.version('weights')}",
                flush=True,
            )
            child.join(timeout=60)  # serve until the consumer has the last one
    finally:
        if child.is_alive():
            child.terminate()
        child.join()
        shutil.rmtree(directory, ignore_errors=True)
    if child.exitcode != 0:
        print(f"producer: the consumer failed (exit code {child.exitcode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
