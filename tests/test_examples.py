"""The examples run as a user runs them: torchrun on 2 CPU ranks, a few steps."""

import os
import re
import subprocess
import sys

import pytest

from support import models
from support import cores
from support.torchrun import torchrun_command as launch
from support.training import check_updates

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun_command(script, args, launcher=(), ranks=2):
    """torchrun of ``ranks`` ranks (``launcher``: more torchrun options) running an example on
    CPUs (--device cpu: on a one-GPU machine, ``auto`` would too, but the test means gloo),
    lowered with the suite's backend (``models.BACKEND``)."""
    return launch(ranks, os.path.join(ROOT, "examples", script), "--device", "cpu", "--backend",
                  models.BACKEND, *args, launcher=launcher)


def torchrun(script, *args, ranks=2):
    run = cores.run(torchrun_command(script, args, ranks=ranks), capture_output=True,
                    text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def torchrun_as_two_nodes(script, *args):
    """Two torchrun agents of 2 ranks each, meeting at a c10d rendezvous on this machine as
    two nodes would meet at their first node's address; both outputs, joined."""
    from bench.helpers.runs import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    launcher = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", "two-nodes")
    with cores.the_cores():
        agents = [subprocess.Popen(torchrun_command(script, args, launcher),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   cwd=ROOT) for _ in range(2)]
        outputs = []
        try:
            for agent in agents:
                out, err = agent.communicate(timeout=300)
                assert agent.returncode == 0, err[-3000:]
                outputs.append(out)
        finally:
            for agent in agents:
                agent.kill()
    return "".join(outputs)


def losses(stdout):
    """Each step's loss, by step number, from the progress lines."""
    return {int(step): float(loss) for step, loss in
            re.findall(r"step +(\d+)/\d+  loss (\d+\.\d+)  ", stdout)}


SMALL_GPT = ("--precision", "bf16", "--accumulation-steps", "2", "--max-grad-norm", "1.0",
             "--layers", "2", "--width", "64", "--heads", "2", "--seq", "16", "--eval-every", "4",
             "--seed", "1")
"""train_gpt.py's options of the run below (with --data): bf16, 2 micro-batches a step,
clipping, a held-out evaluation every 4 steps, a small model."""


@pytest.fixture(scope="module")
def small_gpt(tmp_path_factory):
    """The options of train_gpt.py's run on its own text file (SMALL_GPT and --data), and
    what 8 uninterrupted steps of it print (peak learning rate 1e-2 after 2 warmup steps):
    checked below, and the run the checkpoint test stops and resumes (one torchrun less)."""
    data = tmp_path_factory.mktemp("small_gpt") / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 100)
    options = (*SMALL_GPT, "--data", str(data))
    return options, torchrun("train_gpt.py", "--steps", "8", *options, "--lr", "1e-2",
                             "--warmup-steps", "2")


def test_train_gpt_with_bf16_accumulation_and_clipping_on_a_file_of_its_size(small_gpt):
    """Its own text file and model size, bf16, 2 micro-batches a step, clipping; the learning
    rate warms up then decays; a held-out evaluation every 4 steps and at the end."""
    _, out = small_gpt
    assert "(2 layers, width 64, 2 heads, 16 tokens)" in out and "4,050 bytes of text.txt" in out
    norms = [float(m) for m in re.findall(r"grad norm (\d+\.\d+)", out)]
    assert len(losses(out)) == len(norms) == 8
    assert losses(out)[8] < losses(out)[1]  # it learns
    rates = [float(r) for r in re.findall(r"  lr (\d\.\d+e[-+]\d+)  ", out)]
    assert rates[:2] == [5e-3, 1e-2] and rates[2:] == sorted(rates[2:], reverse=True)
    assert rates[-1] > 1e-3  # the cosine ends at a tenth of the peak, after the last step
    assert len(re.findall(r"\d tok/s", out)) == 8 and re.search(r"throughput [\d,]+ tokens/s", out)
    held_out = [float(m) for m in re.findall(r"held-out loss (\d+\.\d+)", out)]
    assert len(held_out) == 2 and held_out[1] < held_out[0]  # after step 4, and at the end
    assert "traffic per step" in out and "memory on rank 0" in out


def test_train_gpt_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path, small_gpt):
    """The checkpoint holds the learning-rate schedule too: the resumed run continues it (its
    own different --lr and --warmup-steps are reported and ignored). The run is the one
    above (bf16, 2 micro-batches a step, clipping), stopped after 4 of its 8 steps: resumed,
    its last 4 losses are those of the 8 steps taken without stopping."""
    options, whole = small_gpt
    folder = str(tmp_path / "ckpt")
    first = torchrun("train_gpt.py", "--steps", "4", "--decay-steps", "8", *options,
                     "--lr", "1e-2", "--warmup-steps", "2",
                     "--checkpoint-every", "2", "--checkpoint-dir", folder)
    assert "saved" in first and os.path.isdir(os.path.join(folder, "latest"))
    resumed = torchrun("train_gpt.py", "--steps", "8", *options, "--checkpoint-dir", folder,
                       "--lr", "0.5", "--warmup-steps", "1")
    assert "resumed from" in resumed and "after step 4" in resumed
    assert "the learning-rate schedule continues as saved" in resumed
    assert sorted(losses(resumed)) == [5, 6, 7, 8]
    assert [losses(resumed)[s] for s in (5, 6, 7, 8)] == [losses(whole)[s] for s in (5, 6, 7, 8)]
    assert [losses(first)[s] for s in (1, 2, 3, 4)] == [losses(whole)[s] for s in (1, 2, 3, 4)]


def test_train_gpt_on_two_nodes_sharded_within_each():
    """README "Hybrid sharding over nodes": two torchrun agents (nodes) of two ranks; the
    shards stay within a node, and only the gradient shards' all-reduce crosses. A GPT of 2
    blocks of width 64 rather than the script's 4 of 128: what is checked (the mesh, the
    loss falling, the traffic within a shard group against that across replicas, both
    proportional to the parameters) holds at any size, and 4 ranks on 2 cores each capture
    half the blocks."""
    out = torchrun_as_two_nodes("train_gpt.py", "--steps", "6", "--hybrid", "--layers", "2",
                                "--width", "64")
    assert "hybrid sharding: 2 replica(s) of 2 rank(s)" in out
    assert len(losses(out)) == 6 and losses(out)[6] < losses(out)[1]
    found = re.search(r"\(([\d,]+) B within the shard group, ([\d,]+) B across replicas\)", out)
    within, across = (int(n.replace(",", "")) for n in found.groups())
    assert 0 < across < within


def test_finetune_hf_llama_on_synthetic_instructions():
    pytest.importorskip("transformers")
    out = torchrun("finetune_llama.py", "--steps", "30")
    assert len(losses(out)) == 30
    assert losses(out)[30] < losses(out)[1] - 0.5  # it learns the answers
    assert re.search(r"answer accuracy on held-out examples: \d+\.\d%", out)


def test_finetune_llama_loads_into_shards_and_saves_what_transformers_reloads(tmp_path):
    """A tiny saved Llama: built on meta, load_pretrained on 2 ranks (stage 3), 3 steps,
    save_pretrained from the full state dict. transformers reloads the folder, and its logits
    equal the trained model's (the script compares them) and those of the same 3 steps taken
    in one process without zero_fx."""
    transformers = pytest.importorskip("transformers")
    import torch

    sys.path.insert(0, ROOT)
    from examples import hf_models
    from examples.finetune_llama import HELD_OUT, global_batch

    torch.manual_seed(3)
    model = hf_models.causal_lm(hf_models.llama_config(256, 16, layers=2, width=64, heads=4,
                                                       kv_heads=2, ffn=128))
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    model.save_pretrained(base)
    out = torchrun("finetune_llama.py", "--model-dir", str(base), "--steps", "3",
                   "--batch-size", "8", "--lr", "1e-2", "--save-dir", str(tuned))
    assert "loaded 21 tensors" in out and len(losses(out)) == 3
    assert "its logits on held-out examples differ from the trained model's by at most 0\n" in out

    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(3):  # the reference: the same steps on the whole batch, one process
        tokens, mask, labels = global_batch(step, 8)
        model(input_ids=tokens, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tuned)
    tokens, mask, _ = global_batch(HELD_OUT, 8)
    with torch.no_grad():
        difference = (reloaded(input_ids=tokens, attention_mask=mask).logits
                      - model(input_ids=tokens, attention_mask=mask).logits).abs().max().item()
    print(f"reloaded against one process: logits differ by {difference:.3g}")
    assert difference < 1e-5  # measured 1.0e-6: the order of a sum over 2 ranks
    expected = {n: p.detach() for n, p in model.named_parameters()}
    check_updates([{"params": dict(reloaded.named_parameters())}],
                  {"params": expected, "initial": initial}, 1e-3)  # measured 7.5e-6 (v_proj)


def test_lora_trains_the_adapters_leaves_the_frozen_base_alone_and_saves_them_alone(tmp_path):
    import torch

    path = tmp_path / "adapter.pt"
    out = torchrun("lora.py", "--steps", "20", "--lora-rank", "4", "--adapter-path", str(path))
    assert losses(out)[20] < losses(out)[1] and "(rank-4 adapters)" in out
    reduced, adapters = re.search(
        r"gradient reduction per step: ([\d,]+) elements \(the adapters: ([\d,]+) parameters\)", out).groups()
    assert reduced == adapters  # no gradient of the frozen base is reduced
    assert "frozen base unchanged: True" in out
    saved = torch.load(path, weights_only=True)
    weights = saved["weights"]
    assert saved["lora_rank"] == 4 and len(weights) == 4 * 4 * 2  # 4 blocks of 4 layers: down, up
    assert all(name.endswith((".down.weight", ".up.weight")) for name in weights)
    assert f"{sum(t.numel() for t in weights.values()):,}" == adapters  # the adapters, only
    assert all(t.shape[0 if name.endswith("down.weight") else 1] == 4
               for name, t in weights.items())
    assert all(t.abs().sum() > 0 for t in weights.values())  # trained: up starts at zero


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_step_clock_waits_for_a_gpu_and_measures_the_peak_after_compiling(monkeypatch, device):
    """No GPU needed: the CUDA calls are recorded, not made."""
    import torch

    sys.path.insert(0, ROOT)
    from examples.summary import StepClock

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset peak"))
    clock = StepClock(torch.device(device))
    for step in range(3):
        clock.start()
        calls.append(f"step {step}")
        clock.stop()
    if device == "cpu":
        assert calls == ["step 0", "step 1", "step 2"]
    else:  # the clock is read only after the device has finished; the peak leaves the first out
        assert calls == ["synchronize", "step 0", "synchronize",
                         "synchronize", "reset peak", "step 1", "synchronize",
                         "synchronize", "step 2", "synchronize"]
    assert len(clock.seconds) == 3 and clock.peak_span == "steps after the first"


def test_train_mixtral_routes_its_experts_with_fixed_shapes_and_learns():
    """HF Mixtral at stage 3: its MoE blocks are rewritten before the first capture, the
    router's load-balancing loss is part of the objective, and the loss falls."""
    pytest.importorskip("transformers")
    out = torchrun("train_mixtral.py", "--steps", "8")
    assert len(losses(out)) == 8 and losses(out)[8] < losses(out)[1]  # it learns
    aux = [float(a) for a in re.findall(r"  aux (\d+\.\d+)  ", out)]
    assert len(aux) == 8 and all(a > 0 for a in aux)  # the router loss, printed each step
    assert ("mixture of experts: zero_fx routed 2 block(s) with fixed shapes, 4 experts each, "
            "top-2") in out
    assert "model.layers.1.block_sparse_moe: 4 experts, top-2" in out


def test_train_tensor_parallel_splits_the_layers_over_two_of_four_ranks_and_learns():
    """(shard 2, tp 2): ZeRO over each rank's piece, DTensor's all-reduces on the tp group."""
    out = torchrun("train_tensor_parallel.py", "--tp", "2", "--steps", "6", ranks=4)
    assert len(losses(out)) == 6 and losses(out)[6] < losses(out)[1]
    assert "stage 3 over 2 data-parallel rank(s) x tp 2" in out
    assert re.search(r"tp_all_reduce [\d,]+ elements", out) and "within the tp group" in out


def test_the_documented_loop_with_a_scheduler_clipping_and_a_log_line_runs_on_two_ranks():
    """docs/training-features.md's loop, as shown there: torchrun on 2 ranks; rank
    0 logs each step's loss and clipped norm from inside the step, and no rank breaks the
    graph (a break warns)."""
    script = os.path.join(ROOT, "examples", "train_loop.py")
    with open(script) as f, open(os.path.join(ROOT, "docs", "training-features.md")) as doc:
        assert f.read() in doc.read()  # the page shows the file as it is
    run = cores.run(launch(2, script), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    logged = re.findall(r"^loss (\d+\.\d+), grad norm (\d+\.\d+)$", run.stdout + run.stderr, re.M)
    assert len(logged) == 20, run.stdout[-2000:]  # rank 0 only, once per step
    assert "GraphBreakWarning" not in run.stderr
    assert re.search(r"^done: loss \d+\.\d+, lr 0\.00e\+00$", run.stdout, re.M)
