"""The graph as one self-contained HTML page: every node a row, collectives and parameter
gathers coloured, each collective's flight from issue to wait drawn in lanes beside the
rows, and the estimated memory over the step as an inline SVG.

No network, no external script: the page opens from disk. Its script marks
``<body data-ready="1">`` once it has run and lists any error in ``#errors``
(``data-errors``), which is what the headless-browser test reads.
"""

from __future__ import annotations

import html
from typing import Optional, Sequence

from ..base.formatting import format_bytes
from .graph_listing import COLLECTIVE_KINDS, PHASE_SHORT, NodeRow

LEGEND = (
    ("all_gather", "all-gather"),
    ("reduce_scatter", "reduce-scatter"),
    ("all_reduce", "all-reduce"),
    ("all_to_all", "all-to-all (a quantized reduction)"),
    ("wait", "wait"),
    ("gathered", "full parameter"),
    ("param", "parameter input"),
    ("comm", "zero_fx copy in/out"),
    ("recomputed", "recomputed in the backward"),
    ("update", "optimizer update of a bucket"),
)

_STYLE = """
body { font: 13px/1.35 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; margin: 0 0 4px; } .sub { color: #555; margin-bottom: 10px; }
table { border-collapse: collapse; } td, th { padding: 1px 6px; vertical-align: top; }
th { text-align: left; background: #eee; position: sticky; top: 0; }
#graph { table-layout: fixed; width: 100%; }
#graph td { overflow-wrap: anywhere; }
#graph td.code { font-family: ui-monospace, monospace; white-space: pre-wrap; }
#graph tr.backward td.idx { color: #a33; } #graph tr.forward td.idx { color: #36a; }
td.lane { width: 6px; padding: 0; } td.lane.on { border-left: 3px solid #888; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 6px; border-radius: 3px; }
.all_gather { background: #cfe3ff; } td.lane.all_gather { border-color: #2f6fd6; background: none; }
.reduce_scatter { background: #ffe0c2; } td.lane.reduce_scatter { border-color: #e07b12; background: none; }
.all_reduce { background: #f3d4f7; } td.lane.all_reduce { border-color: #a23bb5; background: none; }
.all_to_all { background: #ffd6d6; } td.lane.all_to_all { border-color: #c23a3a; background: none; }
tr.all_gather td, tr.reduce_scatter td, tr.all_reduce td, tr.all_to_all td { font-weight: 600; }
.wait { background: #e6e6e6; } .gathered { background: #d9f2d9; } .param { background: #eef8e6; }
.comm { background: #f7f7fb; } .recomputed { background: #fff1c2; }
.update { background: #d6f5f0; } tr.update td { font-weight: 600; }
tr.hl-in td { outline: 2px solid #2a2; } tr.hl-out td { outline: 2px solid #d22; }
tr.hl td { outline: 2px solid #000; }
#errors { color: #b00; font-weight: 600; }
.note { color: #555; } .controls { margin: 8px 0; }
body.only-zero #graph tr.compute, body.only-zero #graph tr.input { display: none; }
"""

_SCRIPT = """
(function () {
  const rows = new Map();
  document.querySelectorAll('#graph tr[data-name]').forEach(r => rows.set(r.dataset.name, r));
  const users = new Map();
  rows.forEach((r, name) => (r.dataset.in ? r.dataset.in.split(' ') : []).forEach(i => {
    if (!users.has(i)) users.set(i, []);
    users.get(i).push(name);
  }));
  function clear() {
    document.querySelectorAll('.hl, .hl-in, .hl-out').forEach(
      e => e.classList.remove('hl', 'hl-in', 'hl-out'));
  }
  rows.forEach((r, name) => r.addEventListener('click', () => {
    clear();
    r.classList.add('hl');
    (r.dataset.in ? r.dataset.in.split(' ') : []).forEach(i => rows.get(i)?.classList.add('hl-in'));
    (users.get(name) || []).forEach(u => rows.get(u)?.classList.add('hl-out'));
  }));
  document.getElementById('only-zero').addEventListener('change',
    e => document.body.classList.toggle('only-zero', e.target.checked));
  document.getElementById('shown-collectives').textContent =
    document.querySelectorAll('#graph tr.collective').length;
  document.body.dataset.ready = '1';
})();
"""

_ERRORS = """
window.addEventListener('error', e => {
  const box = document.getElementById('errors');
  box.textContent += 'script error: ' + e.message + '\\n';
  document.body.dataset.errors = (+(document.body.dataset.errors || 0) + 1).toString();
});
"""


def render_graph_html(rows: Sequence[NodeRow], title: str, *, subtitle: str = "",
                      memory: Optional[Sequence[int]] = None, links: str = "") -> str:
    """The page for one graph; ``memory``: estimated bytes alive at each row, for the chart."""
    spans, lanes = _collective_lanes(rows)
    collectives = [r for r in rows if r.kind in COLLECTIVE_KINDS]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style>",
        f"<script>{_ERRORS}</script></head><body>",
        f"<h1>{html.escape(title)}</h1><div class='sub'>{html.escape(subtitle)}</div>",
        links,
        "<pre id='errors'></pre>",
        "<div class='legend'>" + "".join(
            f"<span class='{kind}'>{label}</span>" for kind, label in LEGEND) + "</div>",
        _memory_svg(memory, rows) if memory else "",
        f"<h2>Collectives ({len(collectives)}; <span id='shown-collectives'>?</span> drawn)</h2>",
        _collective_table(collectives, spans),
        "<h2>Graph</h2><div class='controls'><label><input type='checkbox' id='only-zero'> "
        "only what zero_fx inserted (collectives, waits, copies, parameters)</label> · "
        "click a row: its inputs in green, its users in red</div>",
        _graph_table(rows, spans, lanes),
        f"<script>{_SCRIPT}</script></body></html>",
    ]
    return "\n".join(parts)


def _collective_lanes(rows: Sequence[NodeRow]) -> tuple[dict[int, tuple[int, int, int]], int]:
    """Collective row index -> (issue row, wait row, lane), and the lane count; lanes are assigned
    so that overlapping flights never share one."""
    wait_of = {}
    for r in rows:
        if r.kind == "wait" and r.inputs:
            wait_of[r.inputs[0]] = r.index
    spans: dict[int, tuple[int, int]] = {}
    lane_free: list[int] = []
    lane_of: dict[int, int] = {}
    for r in rows:
        if r.kind not in COLLECTIVE_KINDS:
            continue
        end = wait_of.get(r.name, r.index)
        lane = next((i for i, free in enumerate(lane_free) if free < r.index), len(lane_free))
        if lane == len(lane_free):
            lane_free.append(end)
        lane_free[lane] = end
        spans[r.index] = (r.index, end)
        lane_of[r.index] = lane
    return {i: (start, end, lane_of[i]) for i, (start, end) in spans.items()}, len(lane_free)


def _collective_table(collectives: Sequence[NodeRow], spans) -> str:
    if not collectives:
        return "<p>none: one rank, or a graph before the collectives are inserted</p>"
    head = "<tr><th>kind</th><th>node</th><th>issued</th><th>waited</th><th>what</th></tr>"
    body = "".join(
        f"<tr class='{r.kind}'><td>{r.kind}</td><td><a href='#n{r.index}'>{html.escape(r.name)}"
        f"</a></td><td>{r.index}</td><td><a href='#n{spans[r.index][1]}'>{spans[r.index][1]}</a>"
        f"</td><td>{html.escape(r.note)}</td></tr>" for r in collectives)
    return f"<table id='collectives'>{head}{body}</table>"


def _graph_table(rows: Sequence[NodeRow], spans, lanes: int) -> str:
    in_flight: list[list[str]] = [[""] * lanes for _ in rows]
    kinds = {r.index: r.kind for r in rows}
    for index, (start, end, lane) in spans.items():
        for i in range(start, end + 1):
            in_flight[i][lane] = kinds[index]
    lane_cols = "<col style='width:7px'>" * lanes
    lane_head = "<th class='lane'></th>" * lanes
    out = [f"<table id='graph'><colgroup>{lane_cols}<col style='width:4em'><col style='width:3.5em'>"
           "<col style='width:16em'><col style='width:11em'><col><col style='width:24em'>"
           f"</colgroup><tr>{lane_head}<th>#</th><th>phase</th><th>node</th>"
           "<th>value</th><th>op(args)</th><th>zero_fx</th></tr>"]
    for r in rows:
        lanes_html = "".join(f"<td class='lane on {k}'></td>" if k else "<td class='lane'></td>"
                             for k in in_flight[r.index])
        classes = f"{r.kind} {r.phase}" + (" collective" if r.kind in COLLECTIVE_KINDS else "")
        call = r.op if r.op == "input" else f"{r.op}({r.args})"
        out.append(
            f"<tr id='n{r.index}' class='{classes}' data-name='{html.escape(r.name)}' "
            f"data-in='{html.escape(' '.join(r.inputs))}'>{lanes_html}<td class='idx'>{r.index}</td>"
            f"<td>{PHASE_SHORT[r.phase]}</td><td class='code'>{html.escape(r.name)}</td>"
            f"<td class='code'>{html.escape(r.value)}</td><td class='code call'>{html.escape(call)}</td>"
            f"<td class='note'>{html.escape(r.note)}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def _memory_svg(memory: Sequence[int], rows: Sequence[NodeRow], width: int = 900,
                height: int = 160) -> str:
    top = max(memory) or 1
    n = max(len(memory) - 1, 1)

    def x(i: int) -> float:
        return 40 + i / n * (width - 50)

    def y(v: int) -> float:
        return height - 20 - v / top * (height - 35)

    backward = next((r.index for r in rows if r.phase == "backward"), None)
    points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(memory))
    peak = max(range(len(memory)), key=memory.__getitem__)
    shade = (f"<rect x='{x(backward):.1f}' y='10' width='{x(n) - x(backward):.1f}' "
             f"height='{height - 30}' fill='#fbeaea'/><text x='{x(backward) + 4:.1f}' "
             f"y='{height - 24}' fill='#a33'>backward</text>") if backward is not None else ""
    return (
        "<h2>Estimated memory per rank over the step</h2><div class='note'>bytes of the tensors "
        "this graph creates, alive at each node (its inputs and the optimizer state come on "
        "top); see explain.txt</div><svg id='memory' width='{width}' "
        f"height='{height}' role='img'>{shade}"
        f"<polyline fill='none' stroke='#2f6fd6' stroke-width='1.5' points='{points}'/>"
        f"<circle cx='{x(peak):.1f}' cy='{y(memory[peak]):.1f}' r='4' fill='#d22'/>"
        f"<text x='{min(x(peak) + 6, width - 200):.1f}' y='{y(memory[peak]) + 4:.1f}'>peak "
        f"{format_bytes(memory[peak])} at <a href='#n{peak}'>#{peak}</a></text>"
        f"<text x='4' y='{y(top) + 4:.1f}' font-size='10'>{format_bytes(top)}</text>"
        f"<text x='4' y='{height - 16}' font-size='10'>0</text>"
        f"<text x='{x(n) - 60:.1f}' y='{height - 4}' font-size='10'>node {n}</text></svg>")
