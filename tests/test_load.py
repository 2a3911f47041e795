"""Load: many consumer processes x get/read/release cycles against one publisher.

The guarantee: under sustained load from many processes every get reads exactly the published data,
and the publisher's memory and descriptors stay flat (leases, connections and their threads are given
back as fast as they are taken). The load itself is ``benchmarks/bench_load.py``'s ``run_load``: this
test runs it in a small profile (two rounds of 8 consumers x 50 cycles) and asserts correctness and
flatness, not speed. ``AIB_LONG=1`` runs the long profile (two rounds of 64 consumers x 1,000
cycles); the benchmark prints the figures (throughput, p50/p99 per get, publisher RSS and fds).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # spawn children inherit it

import bench_load

LONG = os.environ.get("AIB_LONG") == "1"
CONSUMERS, CYCLES = (64, 1000) if LONG else (8, 50)
RSS_GROWTH_LIMIT_MIB = 32.0  # generous: a leak per cycle would be megabytes per thousand gets


def test_many_consumers_read_correct_data_and_the_publisher_stays_flat() -> None:
    figures = bench_load.run_load(CONSUMERS, CYCLES, rows=2_000, rounds=2)
    print(figures)
    assert figures["wrong_reads"] == 0, figures["wrong_examples"]
    assert figures["gets"] == 2 * CONSUMERS * CYCLES
    assert figures["publisher_fds_after_each_round"] == [figures["publisher_fds_before"]] * 2
    growth = figures["publisher_rss_after_mib"] - figures["publisher_rss_before_mib"]
    assert growth < RSS_GROWTH_LIMIT_MIB, f"publisher RSS grew by {growth:.1f} MiB under load"
