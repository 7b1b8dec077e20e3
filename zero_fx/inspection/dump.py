"""Graph dumps: each compilation's graph before and after every pass, as text and HTML,
plus ``explain.txt`` and the memory plot, in one folder per rank and compilation.

Turned on by ``zero_compile(dump_dir=...)`` or the environment variable
``ZERO_FX_DUMP``. The folder is logged (WARNING on ``zero_fx``, so it shows
without any logging set-up)::

    <dump_dir>/<step>/rank<r>/compile<k>/
        index.html                 links to everything below
        00-captured.txt / .html    the graph as captured
        01-annotate_phases.txt ... after each pass, ours and the user's
        explain.txt                the final graph's explain() report
        memory.png                 estimated memory over the step (needs matplotlib)
"""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path
from typing import NamedTuple

from torch.fx import GraphModule

from ..analysis.memory_timeline import memory_timeline
from ..passes.recompute_activations import RECOMPUTE_META
from .explain import Explanation
from .report_sections import describe_recompute
from .graph_listing import COLLECTIVE_KINDS, format_rows, graph_rows
from .html_view import render_graph_html
from .memory_plot import MATPLOTLIB_MISSING, plot_available, plot_memory

log = logging.getLogger("zero_fx")


class Snapshot(NamedTuple):
    after: str
    """"captured" or the name of the pass that just ran."""
    stem: str
    """File name without extension."""
    nodes: int
    collectives: int


class GraphDump:
    """Writes one compilation's snapshots; pass ``observe`` to ``run_pipeline``."""

    def __init__(self, root: str, step_name: str, rank: int, compile_index: int, plan):
        self.folder = Path(root) / _safe(step_name) / f"rank{rank}" / f"compile{compile_index}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.plan = plan
        self.step_name = step_name
        self.snapshots: list[Snapshot] = []
        self.regions = False
        """Whether ``regions.txt`` was written."""

    def observe(self, after: str, gm: GraphModule) -> None:
        stem = f"{len(self.snapshots):02d}-{_safe(after)}"
        rows = graph_rows(gm, self.plan)
        collectives = sum(r.kind in COLLECTIVE_KINDS for r in rows)
        title = f"{self.step_name}: {'captured graph' if after == 'captured' else 'after ' + after}"
        subtitle = (f"stage {self.plan.stage}, {self.plan.world_size} rank(s); {len(rows)} nodes, "
                    f"{collectives} collectives")
        if RECOMPUTE_META in gm.meta:
            subtitle += f"; {describe_recompute(gm.meta[RECOMPUTE_META])}"
        (self.folder / f"{stem}.txt").write_text(format_rows(rows, f"{title} ({subtitle})"))
        memory = memory_timeline(gm).transient
        (self.folder / f"{stem}.html").write_text(render_graph_html(
            rows, title, subtitle=subtitle, memory=memory,
            links="<p><a href='index.html'>all snapshots</a></p>"))
        self.snapshots.append(Snapshot(after, stem, len(rows), collectives))

    def write_regions(self, report) -> None:
        """``regions.txt``: what regional compilation made of the graph: the outer graph
        that runs (collectives and calls of the bodies), then each body's graph."""
        parts = [str(report), "", "# the outer graph: it runs as Python, in this order", report.outer_code]
        for region in report.regions:
            parts += [f"# {region.name}: compiled once, called {len(region.runs_at)} time(s)", region.code]
        (self.folder / "regions.txt").write_text("\n".join(parts))
        self.regions = True

    def finish(self, explanation: Explanation) -> Path:
        """Write the report, the plot and the index; log the folder; return it."""
        (self.folder / "explain.txt").write_text(str(explanation))
        plot = ""
        if plot_available():
            plot_memory(explanation.memory, self.folder / "memory.png",
                        title=f"{self.step_name}: stage {self.plan.stage}, "
                              f"{self.plan.world_size} rank(s)")
            plot = "<h2>Estimated memory per rank</h2><img src='memory.png' alt='memory plot'>"
        else:
            log.warning("zero_fx: %s", MATPLOTLIB_MISSING)
        (self.folder / "index.html").write_text(self._index(plot))
        log.warning("zero_fx: wrote graph dumps of %s (%d snapshots, explain.txt) to %s",
                    self.step_name, len(self.snapshots), self.folder)
        return self.folder

    def _index(self, plot: str) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(s.after)}</td><td>{s.nodes}</td><td>{s.collectives}</td>"
            f"<td><a href='{s.stem}.html'>view</a> · <a href='{s.stem}.txt'>text</a></td></tr>"
            for s in self.snapshots)
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.step_name)}"
                "</title><style>body{font:14px system-ui,sans-serif;margin:16px} td,th{padding:2px 10px}"
                "</style></head><body>"
                f"<h1>{html.escape(self.step_name)}: graph dumps</h1>"
                "<table><tr><th>after</th><th>nodes</th><th>collectives</th><th></th></tr>"
                f"{rows}</table><p><a href='explain.txt'>explain.txt</a>"
                + (" · <a href='regions.txt'>regions.txt</a> (the compiled bodies and the graph that "
                   "calls them)" if self.regions else "")
                + f"</p>{plot}</body></html>")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
