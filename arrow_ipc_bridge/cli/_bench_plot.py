"""``bench --plot``: a PNG of each method's median time against the size moved, log-log.

matplotlib is an optional extra (``pip install arrow_ipc_bridge[plot]``), imported only by this
module and only when a plot is asked for; ``load_matplotlib`` is called before any case runs, so a
missing matplotlib is reported before minutes of measuring, not after.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from arrow_ipc_bridge.cli._bench_options import format_size

__all__ = ["PLOT_EXTRA_HINT", "load_matplotlib", "write_plot"]

PLOT_EXTRA_HINT = "pip install arrow_ipc_bridge[plot]"


def load_matplotlib() -> Any:
    """The ``matplotlib.figure`` module; ``ImportError`` without matplotlib."""
    return importlib.import_module("matplotlib.figure")


def write_plot(path: str, figure_module: Any, results: Sequence[dict[str, Any]], title: str) -> None:
    """One line per method (a device and a case), its median at each size, written to ``path`` as a
    PNG. ``results`` are the JSON rows (``device``, ``label``, ``size_bytes``, ``median_us``).
    Raises ``OSError`` when the file cannot be written."""
    devices = {row["device"] for row in results}
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in results:
        name = row["label"] if len(devices) == 1 else f"{row['label']} ({row['device']})"
        lines.setdefault(name, []).append((row["size_bytes"], row["median_us"]))
    figure = figure_module.Figure(figsize=(8, 5), layout="constrained")
    axes = figure.add_subplot()
    sizes = sorted({row["size_bytes"] for row in results})
    for name, points in lines.items():
        points.sort()
        bridge = name.startswith("bridge")
        axes.plot(
            [size for size, _ in points],
            [median for _, median in points],
            marker="o",
            linestyle="-" if bridge else "--",
            label=name,
        )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(sizes, [format_size(size) for size in sizes])
    axes.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)  # the sizes alone
    axes.set_xlabel("size moved (all columns)")
    axes.set_ylabel("median time per hand-off (µs)")
    axes.set_title(title)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize="small")
    figure.savefig(path, format="png", dpi=120)
