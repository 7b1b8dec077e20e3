"""Model FLOPs utilization (MFU) of a GPT training step, as nanoGPT and PaLM count it:

    MFU = (6·N + 12·L·d·S) × tokens/s per GPU ÷ the GPU's peak dense bf16 FLOP/s

N the parameters without the position embedding (the tied output projection counted once),
L the blocks, d the width, S the sequence length: 6·N for the matmuls with the weights,
forward and backward, 12·L·d·S for attention's score and value matmuls. Recomputed
activations are not counted: recompute is not useful work. The peaks are those of the data
sheets (dense, no sparsity), looked up by ``torch.cuda.get_device_name()``; an unknown
device, or a CPU, has none, and then no MFU.
"""

from __future__ import annotations

from typing import Optional

import torch

from examples.gpt import GPT

FORMULA = ("MFU = (6·N + 12·L·d·S) × tokens/s per GPU ÷ peak dense bf16 FLOP/s (N: "
           "parameters without the position embedding, L blocks, d width, S sequence; "
           "recompute not counted)")

PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12),
                   ("A100", 312e12))
"""(part of the device's name, dense bf16 FLOP/s), the first match wins (the PCIe H100
before the SXM one)."""


def peak_bf16_flops(device_name: Optional[str]) -> Optional[float]:
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in (device_name or "")), None)


def gpt_flops_per_token(config, seq: int) -> int:
    """Training FLOPs per token of an ``examples.gpt`` GPT of ``config`` on sequences of
    ``seq`` tokens (its parameters counted on the meta device)."""
    with torch.device("meta"):
        model = GPT(config)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6 * n + 12 * config.n_layer * config.n_embd * seq


def mfu(flops_per_token: Optional[int], tokens_per_s: float,
        peak_flops: Optional[float]) -> Optional[float]:
    if not flops_per_token or not peak_flops:
        return None
    return flops_per_token * tokens_per_s / peak_flops
