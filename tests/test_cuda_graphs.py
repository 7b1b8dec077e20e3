"""The graph zero_fx builds around CUDA's fused attention kernels, checked without a GPU.

On CUDA, ``F.scaled_dot_product_attention`` becomes one of the fused kernels' aten ops
when the step is traced (``_scaled_dot_product_flash_attention``, ``..._efficient_attention``),
each with its own backward op, and with ``dropout_p`` > 0 a random op: its dropout mask is
drawn from a philox seed and offset that the forward returns and the backward reads. So
the passes must keep the ops whole, and ``recompute="blocks"`` must keep a dropping
attention's outputs rather than run it again (which would draw a new mask), while an
attention without dropout is recomputed like the rest of the block.

Here a GPT whose attention calls those ops itself is traced on fake CPU tensors and
rewritten for stage 3 at 8 ranks (``rewritten_step_on_fake``): the ops' shape functions
do not depend on the device. Fake *CUDA* tensors would be closer, and FakeTensorMode
makes them without a GPU, but autograd aborts the process on a CUDA leaf in a CPU-only
build (``c10::Error`` from ``getDeviceGuardImpl`` in ``InputMetadata``), and zero_fx's
step is forward and backward in one graph. The step on a real GPU is test_cuda.py's.
"""

import collections
import operator

import pytest
import torch
import torch.nn as nn

from examples.gpt import GPT, CausalSelfAttention, GPTConfig
from zero_fx import rewritten_step_on_fake

aten = torch.ops.aten
LAYERS, SEQ, VOCAB = 2, 16, 64
KERNELS = {
    "flash": (aten._scaled_dot_product_flash_attention.default,
              aten._scaled_dot_product_flash_attention_backward.default),
    "efficient": (aten._scaled_dot_product_efficient_attention.default,
                  aten._scaled_dot_product_efficient_attention_backward.default),
}


class FusedAttention(CausalSelfAttention):
    """examples/gpt.py's attention calling a CUDA kernel's op, as SDPA does on a GPU."""

    kernel = "flash"
    dropout_p = 0.0

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.kernel == "flash":
            y = aten._scaled_dot_product_flash_attention(q, k, v, self.dropout_p, True)[0]
        else:
            y = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, self.dropout_p,
                                                             True)[0]
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


def gpt_with(kernel: str, dropout_p: float):
    def build() -> nn.Module:
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2,
                              n_embd=32, bias=False, dropout=0.1))
        for block in model.blocks:
            block.attn.__class__ = FusedAttention
            block.attn.kernel, block.attn.dropout_p = kernel, dropout_p
        return model
    return build


def rewritten(kernel: str, dropout_p: float, recompute):
    gm, _ = rewritten_step_on_fake(gpt_with(kernel, dropout_p), batch=2, seq=SEQ,
                                   vocab_size=VOCAB, world_size=8, stage=3,
                                   dtype=torch.bfloat16, recompute=recompute,
                                   persistence_threshold=0)  # every block gathered
    return gm


def op_counts(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_fused_attention_ops_survive_the_stage3_passes_whole(kernel, dropout_p):
    forward, backward = KERNELS[kernel]
    counts = op_counts(rewritten(kernel, dropout_p, recompute=None))
    assert counts[forward] == counts[backward] == LAYERS
    assert counts[torch.ops._c10d_functional.all_gather_into_tensor.default] > 0


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_blocks_recompute_keeps_a_dropping_attention_and_recomputes_one_without_dropout(kernel):
    forward, backward = KERNELS[kernel]
    with_dropout = op_counts(rewritten(kernel, 0.1, recompute="blocks"))
    without = op_counts(rewritten(kernel, 0.0, recompute="blocks"))
    # the rest of each block is recomputed in both (one more GELU per block)
    assert with_dropout[aten.gelu.default] == without[aten.gelu.default] == 2 * LAYERS
    assert with_dropout[forward] == LAYERS, "a dropping attention was run again: a new mask"
    assert without[forward] == 2 * LAYERS
    assert with_dropout[backward] == without[backward] == LAYERS


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_the_backward_reads_the_forwards_dropout_seed(kernel):
    """Under recompute="blocks", the philox seed and offset each backward op reads are
    outputs of the forward's own attention (kept, not drawn again)."""
    forward, backward = KERNELS[kernel]
    gm = rewritten(kernel, 0.1, recompute="blocks")
    names = [a.name for a in backward._schema.arguments]
    checked = 0
    for node in gm.graph.nodes:
        if node.target is backward:
            for name in ("philox_seed", "philox_offset"):
                source = node.args[names.index(name)]
                assert source.target is operator.getitem and source.args[0].target is forward, (
                    f"{name} of {node.name} comes from {source.format_node()}")
            checked += 1
    assert checked == LAYERS
