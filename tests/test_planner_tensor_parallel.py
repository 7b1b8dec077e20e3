"""Tensor parallelism planned and priced (``python -m zero_fx.plan --tp T``; [Note: planning
tensor parallelism] in zero_fx/planner/features/tensor_parallel.py, [Note: pricing tensor parallelism] in
zero_fx/analysis/cost_model.py): a rank's piece of the model against the formulas written
out here, the 64K-wide layer of the seeds that fits one device only split, the collectives
priced, the re-priced activations against Megatron's count, and what a bad --tp says.

Kept fast: models are built on the meta device (gpt-64k, 4 blocks, in 10 ms) or are tiny
zero_fx torch modules, traced on fake tensors (about a second each); one tiny
tensor-parallel step is compiled on the fake process group (1.5 s) to check the price
against what runs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zero_fx.analysis.hardware import PRESETS
from zero_fx.analysis.transfer_seconds import (TP_COLLECTIVES_PER_BLOCK, data_parallel_ranks,
                                               tensor_parallel_seconds)
from zero_fx.analysis.memory_timeline import memory_timeline
from zero_fx import models as torch_models
from zero_fx.planner.cli import main as plan_main
from zero_fx.planner.models import ModelSource, model_source, on_meta
from zero_fx.planner.offline import causal_lm_loss, rewritten_step_on_fake
from zero_fx.planner.plan_model import plan_model
from zero_fx.planner.printing import format_report
from zero_fx.planner.question import Workload
from zero_fx.planner.features.tensor_parallel import (TensorParallelOptions, _tensor_parallel_shares,
                                             tensor_parallel_prices, tensor_parallel_split)
from zero_fx.planner.table import model_state_breakdown
from zero_fx.models import GPTConfig, LlamaConfig

GB = 1e9
# a small Llama: 4 blocks (what one more block adds is traced), GQA, SwiGLU
LLAMA = LlamaConfig(vocab_size=512, dim=64, n_layer=4, n_head=16, n_kv_head=8, ffn_dim=192,
                    max_positions=256)
GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=4, n_embd=32, bias=False)


def source_of(cfg) -> ModelSource:
    return ModelSource(description="tiny", build=lambda layers=None: torch_models.build(cfg, layers),
                       layers=cfg.n_layer, vocab_size=cfg.vocab_size,
                       max_positions=torch_models.max_positions(cfg))


def llama_piece(cfg: LlamaConfig, t: int) -> int:
    """Elements of one tensor-parallel rank's piece, from the config: each block's seven
    matrices and the embedding and head split, the norms whole."""
    h, kv = cfg.dim, cfg.n_kv_head * cfg.dim // cfg.n_head
    matrices = 2 * h * h + 2 * h * kv + 3 * h * cfg.ffn_dim
    return cfg.n_layer * (matrices // t + 2 * h) + 2 * cfg.vocab_size * h // t + h


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_states_at_tp_1_and_8_are_the_zero_table_of_a_ranks_piece(stage):
    world, t = 16, 8
    report = plan_model(source_of(LLAMA),
                        Workload(world_size=world, stage=stage, dtype=torch.bfloat16),
                        tensor_parallel=TensorParallelOptions(degree=t))
    assert report.psi == llama_piece(LLAMA, 1)
    assert report.psi_per_rank == llama_piece(LLAMA, t)
    dp, whole, piece = world // t, llama_piece(LLAMA, 1), llama_piece(LLAMA, t)
    # bf16 parameters and reductions, fp32 gradients, masters and Adam (8 bytes)
    expected = {0: (2 + 4 + 4 + 8) * piece, 1: (2 + 2) * piece + (4 + 8) * piece / dp,
                2: 2 * piece + (4 + 4 + 8) * piece / dp, 3: (4 + 4 + 8) * piece / dp}[stage]
    assert report.stages[stage].state_bytes == pytest.approx(expected)
    single, split = report.tensor_parallel_rows
    assert (single.degree, split.degree) == (1, t)
    assert single.state_bytes == pytest.approx(sum(model_state_breakdown(
        stage, whole, world, optimizer_bytes=8, param_bytes=2, reduce_bytes=2).values()))
    assert split.state_bytes == pytest.approx(expected)
    if stage == 3:  # Ψ/T over W/T ranks: only the whole norms are counted T times
        assert split.state_bytes - single.state_bytes == pytest.approx(
            16 * (piece * t - whole) / world)
    # a block: seven matrices split, two norms whole; its gradients as many bytes (bf16)
    h = LLAMA.dim
    block = (2 * h * h + 2 * h * h // 2 + 3 * h * LLAMA.ffn_dim) // t + 2 * h
    assert split.block_params == 2 * block and split.block_activations is None
    assert split.block_bytes == 2 * 2 * block


def test_the_split_parameters_are_the_blocks_matrices_and_the_vocabulary_parallel_ones():
    model = on_meta(lambda: torch_models.build(GPTConfig(n_layer=2, n_embd=64, n_head=4)))
    split = tensor_parallel_split(model, 50257)
    assert "wte.weight" in split  # the embedding, tied to the head
    assert {"wpe.weight", "blocks.0.ln1.weight", "blocks.0.attn.qkv.bias", "ln_f.weight"} \
        .isdisjoint(split)  # positions, norms, biases whole
    assert {"blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight", "blocks.1.mlp.0.weight",
            "blocks.1.mlp.2.weight"} <= split


def test_the_64k_wide_layer_fits_80_gb_only_split_over_8_ranks():
    """The seeds' large layer: a block of width 65536 needs 206 GB for its fp16 parameters
    and gradients, and its MLP's first matrix alone is a 34 GB buffer."""
    report = plan_model(model_source("gpt-64k"),
                        Workload(world_size=64, stage=3, dtype=torch.float16),
                        tensor_parallel=TensorParallelOptions(degree=8))
    h = 65536
    block = 12 * h * h + 2 * h  # qkv 3h², proj h², MLP 8h²; two norm weights
    single, split = report.tensor_parallel_rows
    assert single.block_bytes == 2 * 2 * block and single.block_bytes / GB == pytest.approx(206.16, abs=0.01)
    assert split.block_bytes == 2 * 2 * (12 * h * h // 8 + 2 * h)
    assert single.largest_matrix == 2 * 4 * h * h and single.largest_matrix > 32 * GB
    assert split.largest_matrix == single.largest_matrix / 8
    assert single.block_bytes > 80 * GB >= split.block_bytes
    # ZeRO's collectives carry the piece Ψ_T over the 8 data-parallel ranks: gathered twice,
    # reduced once (no parameter is small enough to stay resident), in fp16
    piece = 4 * (12 * h * h // 8 + 2 * h) + 50304 * h // 8 + 2048 * h + h
    assert report.psi_per_rank == piece and report.resident == 0
    assert split.zero_bytes == 2 * 3 * piece and single.zero_bytes == 2 * 3 * report.psi
    assert split.tp_bytes == split.tp_seconds == 0  # no --seq: no tokens to price
    text = format_report(report, device_memory_gb=80)
    assert "| 1 (data parallel only) |" in text and "206.16 GB (does NOT fit)" in text
    assert "25.77 GB (fits)" in text


def test_tensor_parallel_collectives_are_priced_per_block_and_zero_over_the_dp_ranks():
    world, t, seq = 16, 8, 64
    hw = PRESETS["4x8xh100-ib"]
    report = plan_model(source_of(LLAMA),
                        Workload(world_size=world, dtype=torch.bfloat16, seq=seq),
                        tensor_parallel=TensorParallelOptions(degree=t), hardware="4x8xh100-ib")
    single, split = report.tensor_parallel_rows
    nbytes = seq * LLAMA.dim * 2  # b·s·h in bf16
    count = TP_COLLECTIVES_PER_BLOCK * LLAMA.n_layer + 2  # and the embedding and head
    assert split.tp_bytes == count * nbytes and single.tp_bytes == 0
    # an all-reduce over 8 ranks of one node: 2 (T-1) steps of 1/T of the bytes on NVLink
    one = 2 * (t - 1) * (hw.link_latency + nbytes / t / hw.link_bandwidth)
    assert tensor_parallel_seconds(nbytes, t, hw) == pytest.approx(one)
    assert split.tp_seconds == pytest.approx(count * one) and single.tp_seconds == 0
    # ZeRO's gathers and reduce-scatters carry the piece, over ranks 0 and 8: two nodes
    assert data_parallel_ranks(world, t) == range(0, 16, 8)
    stage3 = report.stages[3]
    assert sum(stage3.traffic.values()) == split.zero_bytes
    assert split.zero_seconds == pytest.approx(sum(
        (hw.inter_node_latency + size / 2 / hw.inter_node_bandwidth)
        for size in stage3.traffic.values()))
    assert split.step_seconds == pytest.approx(
        max(split.compute_seconds, split.zero_seconds) + split.tp_seconds)
    assert split.compute_seconds == pytest.approx(single.compute_seconds / t)


def test_activations_follow_megatrons_count_and_sequence_parallelism_splits_them_all():
    """A GPT block keeps 32·sbh bytes in 16-bit without dropout (Megatron: 34, 2 of them dropout
    masks), of which 8·sbh (the norms' inputs, the inputs of the first products) stay whole
    under tensor parallelism; with sequence parallelism every byte is split."""
    cfg = GPTConfig(vocab_size=512, block_size=256, n_layer=4, n_head=4, n_embd=256, bias=False)
    t, seq = 4, 256
    rows = {}
    for sequence_parallel in (False, True):
        report = plan_model(source_of(cfg), Workload(world_size=8, dtype=torch.float16, seq=seq),
                            tensor_parallel=TensorParallelOptions(
                                degree=t, sequence_parallel=sequence_parallel))
        rows[sequence_parallel] = report.tensor_parallel_rows
    sbh = seq * cfg.n_embd
    single = rows[False][0].block_activations
    assert single == pytest.approx(32 * sbh, rel=0.02)
    assert rows[False][1].block_activations == pytest.approx((8 + 24 / t) * sbh, rel=0.02)
    assert rows[True][1].block_activations == pytest.approx(single / t)
    assert rows[True][1].working_set < rows[False][1].working_set < rows[False][0].working_set


def test_megatrons_split_is_read_from_the_graph():
    """Column-parallel products split their outputs (the MLP's 4h-wide activations, attention),
    row-parallel ones make them whole again (the residual stream, the norms); the logits of
    the vocabulary-parallel head are split; a gathered bucket counts its matrices' share."""
    model = on_meta(lambda: torch_models.build(GPT))
    split = tensor_parallel_split(model, GPT.vocab_size)
    gm, plan = rewritten_step_on_fake(lambda: torch_models.build(GPT), batch=2, seq=16,
                                      vocab_size=GPT.vocab_size, world_size=2, stage=3,
                                      loss_fn=causal_lm_loss)
    shares, params = _tensor_parallel_shares(gm, plan, split, sequence_parallel=False)
    h = GPT.n_embd
    acts = {n.name: n for n in gm.graph.nodes
            if n.name not in params and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].ndim}
    mlp = [name for name, n in acts.items() if n.meta["val"].shape[-1] == 4 * h]
    logits = [name for name, n in acts.items() if n.meta["val"].shape[-1] == GPT.vocab_size]
    norms = [n.name for n in gm.graph.nodes if "native_layer_norm.default" in str(n.target)]
    assert mlp and logits and norms
    assert all(shares[name] == 1.0 for name in mlp + logits)
    assert all(shares[name] == 0.0 for name in norms)
    assert shares["embedding"] == 0.0  # the vocabulary-parallel embedding's output: all-reduced
    timeline = memory_timeline(gm)
    assert {t.node for t in timeline.tensors} <= set(shares)
    with_sp, _ = _tensor_parallel_shares(gm, plan, split, sequence_parallel=True)
    assert all(with_sp[name] == 1.0 for name in acts)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt2", "--world", "64", "--tp", "3"],
     "--tp 3 must divide --world 64: use one of 1, 2, 4, 8, 16, 32, 64"),
    (["--model", "gpt2", "--world", "8", "--tp", "8"],
     "--tp 8 does not divide the model's 12 attention heads"),
    (["--model", "gpt-64k", "--world", "8", "--sequence-parallel"],
     "--sequence-parallel splits what tensor parallelism leaves whole: give --tp > 1 too"),
    (["--model", "gpt-64k", "--world", "64", "--nodes", "8", "--tp", "8"],
     "--tp with --nodes is not planned"),
])
def test_a_bad_tp_says_what_to_change(argv, message, capsys):
    with pytest.raises(SystemExit):
        plan_main(argv)
    assert message in " ".join(capsys.readouterr().err.split())


def test_kv_heads_and_experts_bound_the_degree():
    with pytest.raises(ValueError, match=r"--tp 8 does not divide the model's 4 key/value heads.*"
                                         r"use --tp 1, 2, 4$"):
        plan_model(source_of(replace(LLAMA, n_kv_head=4)), Workload(world_size=8),
                   tensor_parallel=TensorParallelOptions(degree=8))
    moe = LlamaConfig(vocab_size=128, dim=32, n_layer=1, n_head=4, n_kv_head=4, ffn_dim=64,
                      experts=torch_models.Experts(n_experts=4, top_k=2, ffn_dim=32))
    with pytest.raises(ValueError, match="split a mixture of experts with --expert-parallel"):
        plan_model(source_of(moe), Workload(world_size=4),
                   tensor_parallel=TensorParallelOptions(degree=2))


def test_the_priced_working_set_is_the_compiled_tensor_parallel_steps(fake_world_of_four,
                                                                      monkeypatch):
    """The planner's price of tensor parallelism 2, the T = 1 step traced on fake tensors and
    priced again, against the step zero_compile builds for the test GPT split by PyTorch's
    own ColwiseParallel and RowwiseParallel on a (shard 2, tp 2) mesh: within 1 % (measured
    0.4 % here, 0.3-0.5 % with 2 and 4 blocks of width 256)."""
    from torch.distributed.device_mesh import init_device_mesh

    from support import models
    from support import tensor_parallel_models as tpm
    from zero_fx import zero_compile

    for name, value in (("TP_WIDTH", 128), ("TP_HEADS", 4), ("TP_LAYERS", 1)):
        monkeypatch.setattr(models, name, value)
    tokens = torch.randint(0, models.VOCAB, (2, 128))

    def loss_fn(model, x, y):
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def step(model, opt, x, y):
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    torch.manual_seed(0)
    model = tpm.parallelize(models.TensorParallelGPT(), mesh["tp"])
    compiled = zero_compile(step, stage=3, mesh=mesh, backend="aot_eager")
    compiled(model, torch.optim.SGD(model.parameters(), lr=0.01), tokens, tokens)
    measured = max(memory_timeline(compiled.graphs[-1]).transient)

    gm, plan = rewritten_step_on_fake(models.TensorParallelGPT, batch=2, seq=128, vocab_size=models.VOCAB,
                                      world_size=4, stage=3, loss_fn=loss_fn)
    # this GPT's plan without sequence parallelism leaves the embedding and the head whole
    split = tensor_parallel_split(on_meta(models.TensorParallelGPT), models.VOCAB) - {"wte.weight", "head.weight"}
    priced = tensor_parallel_prices(gm, plan, split, 2, sequence_parallel=False)["tp"]
    assert priced == pytest.approx(measured, rel=0.01)
    assert priced < 0.7 * max(memory_timeline(gm).transient)  # and well below T = 1
