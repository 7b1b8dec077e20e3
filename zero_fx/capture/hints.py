"""What to do about the capture failures users meet most, keyed by what PyTorch says.

zero_fx shards and schedules the whole step as one graph (see docs/architecture.md), so a
graph break either runs the step eagerly, with a warning (runtime/eager_fallback.py), or,
with ``on_graph_break="error"``, is an error; never a silent fallback to several graphs.
PyTorch's own messages name the construct but not the way out for a training step; these
hints do. Each pattern was
met on a real model (HuggingFace GPT-2 and Llama, and Mixtral before zero_fx rewrote its
experts: docs/moe.md; docs/huggingface.md, "Models that do not capture").
"""

from __future__ import annotations

from typing import Optional

from .step_graph import CaptureError

_HINTS = (
    (("_grouped_mm_fallback_backward",),
     "transformers' grouped matmul of the experts falls back to a loop over the experts "
     "(torch has no grouped_mm kernel for this device and dtype), and before transformers 5.24 "
     "its backward is Python that reads the group sizes, which PyTorch's tracer cannot follow. "
     "Upgrade to transformers>=5.24, whose fallback backward is one op that captures."),
    (("logging.Logger", "warning_once"),
     "The model logs from inside the step. HuggingFace models do this when `model.loss_type` "
     "is unset (set `model.loss_type = \"ForCausalLM\"`) and when gradient checkpointing meets "
     "`use_cache=True` (set `model.config.use_cache = False`). For another logger, add its "
     "method to `torch._dynamo.config.ignore_logging_functions`."),
    (("Could not guard on data-dependent expression", "Data-dependent branching"),
     "The step branches on a tensor's value (`if loss.item() > x:`, `if tensor:`). Every rank "
     "must run the same collectives, so the graph cannot depend on values: use `torch.where`, "
     "or read the value after the step returns."),
    (("Could not extract specialized integer from data-dependent expression",),
     "A loop count or a size depends on a tensor's values (`for i in tensor:`, a `.item()` or "
     "`.tolist()` used as a size). Every rank must run the same collectives, so no shape in the "
     "step may depend on values. Mixture-of-experts layers loop over the experts that received "
     "tokens: zero_fx rewrites the blocks it recognises to fixed shapes (HuggingFace Mixtral, "
     "Qwen2/3-MoE, OLMoE and DeepSeek-V3 among them; docs/moe.md), so here it met a loop it did "
     "not. A fixed-shape routing layer captures: run every expert on every token and weight its "
     "output by the router's weight (zero where the token did not pick it), or give each expert "
     "a fixed capacity of tokens (scatter into a [experts, capacity, hidden] buffer, dropping "
     "the overflow)."),
    (("PendingUnbackedSymbolNotFound", "Pending unbacked symbols"),
     "A size the data decides reaches the backward: rows sliced at offsets read from a tensor "
     "(`x[start:end]` with `end = counts.cumsum(0)[e]`), as mixture-of-experts layers that hold "
     "their experts as one 3-D parameter do (HuggingFace Aria's sequential GEMM). PyTorch's "
     "tracer cannot carry such sizes through the backward, and zero_fx does not rewrite these "
     "layers yet (docs/moe.md). Give each expert a fixed-size slice: sort the rows by expert and "
     "run every expert on a fixed capacity, or run every expert on every row weighted by its "
     "routing weight."),
    (("aten.nonzero", "DynamicOutputShapeException", "DataDependentOutputException"),
     "An op's output shape depends on the values (boolean-mask indexing `x[mask]`, `nonzero`, "
     "`unique`, `masked_select`). Use a fixed-shape form: `torch.where`, `masked_fill`, or "
     "`ignore_index=-100` in the labels for tokens the loss should skip."),
)


def capture_hint(message: str) -> Optional[str]:
    """The advice for a capture failure whose PyTorch message is ``message``, if known."""
    for needles, hint in _HINTS:
        if any(needle in message for needle in needles):
            return hint
    return None


def capture_failed(err: BaseException) -> CaptureError:
    """PyTorch could not capture the step as one graph: its message, and ours on what to do."""
    advice = capture_hint(str(err)) or "Move the unsupported code out of the decorated step."
    return CaptureError(f"zero_fx captures the whole step as one graph, and PyTorch could not: "
                        f"{_without_user_stack(str(err))}\n{advice}")


def _without_user_stack(message: str) -> str:
    """Dynamo's message up to its user stack and debugging tips (the traceback chained to
    the CaptureError shows the stack; the message keeps the cause and the line it names)."""
    kept = []
    for line in message.splitlines():
        if line.startswith(("User Stack", "For more information", "For extended logs",
                            "If you suspect", "For more debugging help")):
            break
        if line.strip():
            kept.append(line)
    return "\n".join(kept)
