"""Summaries of timing samples, shared by the benchmark scripts (bench_host.py, the GPU bench's
children): median and tails by the same rule everywhere, so their tables compare."""

from __future__ import annotations

import math
from typing import Any


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats_us(samples_s: list[float]) -> dict[str, Any]:
    """Summary of durations given in seconds, reported in microseconds."""
    s = sorted(x * 1e6 for x in samples_s)
    return {
        "n": len(s),
        "median_us": percentile(s, 0.5),
        "p90_us": percentile(s, 0.9),
        "p99_us": percentile(s, 0.99),
        "min_us": s[0] if s else math.nan,
        "max_us": s[-1] if s else math.nan,
        "mean_us": sum(s) / len(s) if s else math.nan,
    }
