"""``--plot out.png``: time and bus bandwidth against message size, one curve per backend.

matplotlib is an optional extra (``pip install 'hora[plot]'``); ``require`` checks for it
before anything is measured, so a missing matplotlib never costs a finished run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hora.bench.plan import human_bytes


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require() -> None:
    """Raises PlotUnavailable, saying how to install it, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install 'hora[plot]' (or pip install matplotlib)"
        ) from None


def draw(path: str, reports: Mapping[str, Mapping[str, Any]], plan: Mapping[str, Any], title: str) -> None:
    """Writes one row per collective: time per op (log-log) and busbw (GB/s) against size.

    Args:
        path: the image file (its suffix picks the format: .png, .svg, .pdf).
        reports: each backend's merged results, hora first.
        plan: the plan (for the dtype, op and collectives).
        title: the figure's title (world size, machine).
    """
    require()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collectives = list(plan["collectives"])
    figure, axes = plt.subplots(len(collectives), 2, figsize=(12, 4 * len(collectives)), squeeze=False)
    for row, collective in enumerate(collectives):
        time_axis, bw_axis = axes[row]
        for name, report in reports.items():
            points = [r for r in report["results"] if r["collective"] == collective]
            if not points:
                continue
            sizes = [r["bytes"] for r in points]
            style = {"linewidth": 2.5 if name == "hora" else 1.5, "marker": "o", "markersize": 3, "label": name}
            time_axis.plot(sizes, [r["time_s"] * 1e6 for r in points], **style)
            bw_axis.plot(sizes, [r["busbw_gbps"] for r in points], **style)
        for axis, label in ((time_axis, "time per op (us)"), (bw_axis, "bus bandwidth (GB/s)")):
            axis.set_xscale("log", base=2)
            axis.set_xlabel("message size")
            axis.set_ylabel(label)
            axis.grid(True, which="both", alpha=0.3)
            powers = [s for s in plan["sizes"] if s & (s - 1) == 0] or list(plan["sizes"])
            ticks = powers[:: -(-len(powers) // 8)]  # at most 8 labels
            axis.set_xticks(ticks)
            axis.set_xticklabels([human_bytes(t).replace(" ", "") for t in ticks], fontsize=8)
        time_axis.set_yscale("log")
        op = f" {plan['op']}" if collective in ("allreduce", "reducescatter") else ""
        time_axis.set_title(f"{collective} ({plan['dtype']}{op}): time")
        bw_axis.set_title(f"{collective}: bus bandwidth")
        bw_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(path, dpi=110)
    plt.close(figure)
