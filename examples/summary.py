"""The examples' closing report: loss, compile and step time, memory and traffic per rank."""

from __future__ import annotations

import torch

MiB = 2 ** 20


def held_bytes(train_step) -> int:
    """Bytes of parameters, shards, gradients and optimizer state this rank holds now."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in train_step.state.held_tensors()}
    return sum(storages.values())


def summary(train_step, *, final_loss: float, step_seconds: list[float], device: torch.device) -> str:
    steady = sorted(step_seconds[1:]) or step_seconds
    median = steady[len(steady) // 2]
    if device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated(device) / MiB:.1f} MiB (CUDA allocator)"
    else:  # CPU keeps no allocator statistics: the cost model's estimate from the graph
        peak = (f"{train_step.estimate().peak_bytes / MiB:.1f} MiB (estimated from the graph; "
                "CPU has no allocator statistics)")
    traffic = train_step.traffic()
    return "\n".join([
        f"done: final loss {final_loss:.4f}",
        f"compile (capture + passes + lowering): {sum(train_step.compile_seconds):.1f} s; "
        f"median step after the first: {1e3 * median:.1f} ms",
        f"memory on rank 0: {held_bytes(train_step) / MiB:.2f} MiB held between steps "
        f"(parameters, shards, optimizer state); peak during a step {peak}",
        f"traffic per step: {traffic.summary()}",
    ])
