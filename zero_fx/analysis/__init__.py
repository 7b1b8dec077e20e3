"""What a rewritten step costs, read off its graph or counted while it runs. By role:

- read off the graph: ``traffic`` (bytes on the wire), ``memory_timeline`` (what is alive at
  each node), ``model_state`` (device and host bytes of the model state);
- priced: ``cost_model`` (time and peak on given hardware), ``transfer_seconds`` (a
  collective's or a copy's duration by formula), ``hardware`` (the ranks, links and presets);
- counted on a real run, to check those: ``collective_counter``, ``live_memory``,
  ``host_syncs``.

Reads graphs and changes none; imports only the layers below it (passes/, capture/, the
leaves: docs/architecture.md, "The layers")."""
