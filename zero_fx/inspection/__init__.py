"""What a compiled step shows a person. By role:

- ``explain``: the report, top to bottom, with its sections in ``plan_section`` (ranks,
  shards, buckets, what each option changed), ``report_sections`` (host copies, memory,
  recompute, compilations) and ``step_facts`` (what it reads off the rewritten graph);
- the graph: ``graph_listing`` (one row per node), rendered by ``dump`` (a folder per rank
  and compilation, each pass's graph as text and HTML) and ``html_view`` (one
  self-contained page); ``memory_plot``: the estimated memory as a PNG."""
