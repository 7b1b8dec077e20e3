"""What a rewritten step costs, read off its graph or counted while it runs: bytes on the
wire (``traffic``), the memory timeline (``memory_timeline``), the cost model's time and
peak (``cost_model``), and the counters that measure a real run (``collective_counter``,
``live_memory``). Reads graphs and changes none; imports only the layers below it
(passes/, capture/, the leaves: docs/architecture.md, "The layers")."""
