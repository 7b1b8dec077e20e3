"""The estimated memory over a step as a PNG (matplotlib, an optional dependency)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..analysis.memory_timeline import MemoryTimeline

MATPLOTLIB_MISSING = ("the memory plot (memory.png) needs matplotlib: pip install matplotlib "
                      "(the same curve is in the HTML view)")


def plot_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_memory(memory: MemoryTimeline, path: Path, *, title: str) -> None:
    """Bytes alive per node, forward and backward shaded, the peak marked and labelled."""
    from matplotlib.figure import Figure  # no pyplot: the user's backend stays as it is

    mib = [b / 2**20 for b in memory.total]
    fig = Figure(figsize=(10, 3.6), dpi=110)
    ax = fig.add_subplot()
    ax.plot(range(len(mib)), mib, color="#2f6fd6", linewidth=1.2)
    ax.axhline(memory.persistent_bytes / 2**20, color="#888", linestyle=":", linewidth=1,
               label="persistent (inputs, optimizer state)")
    backward = [i for i, phase in enumerate(memory.phases) if phase == "backward"]
    if backward:
        ax.axvspan(backward[0], len(mib) - 1, color="#fbeaea", label="backward")
    peak = memory.peak_index
    ax.plot([peak], [mib[peak]], "o", color="#d22")
    ax.annotate(f"peak {mib[peak]:.2f} MiB at node {peak} ({memory.node_names[peak]})",
                (peak, mib[peak]), textcoords="offset points", xytext=(8, -4), fontsize=8)
    ax.set_xlabel("node of the rewritten graph (execution order)")
    ax.set_ylabel("MiB per rank (estimated)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
