"""load_pretrained (zero_fx/materialize/pretrained.py): HuggingFace safetensors, as save_pretrained
writes them, read straight into each rank's shards; equal to from_pretrained; each rank reads
about 1/N of the files and holds no more than its shards and one tensor while loading; a file
that does not fit the model is an error that says how."""

import gc
import os

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from support import models  # noqa: E402
from examples import hf_models  # noqa: E402
from support.ranks import run_ranks  # noqa: E402
from zero_fx import CheckpointError, load_pretrained, zero_compile  # noqa: E402

VOCAB = 256


def llama(tied: bool = False, layers: int = 2, width: int = 64, meta: bool = False):
    config = hf_models.llama_config(VOCAB, models.SEQ, layers=layers, width=width, heads=4,
                                    kv_heads=2, ffn=2 * width)
    config.tie_word_embeddings = tied
    if meta:
        with torch.device("meta"):
            return hf_models.causal_lm(config)
    return hf_models.causal_lm(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One Llama saved by save_pretrained as one file and sharded (an index and several files)."""
    torch.manual_seed(3)
    model = llama()
    folders = {"single": tmp_path_factory.mktemp("single"),
               "sharded": tmp_path_factory.mktemp("sharded")}
    model.save_pretrained(folders["single"])
    model.save_pretrained(folders["sharded"], max_shard_size="100KB")
    assert os.path.exists(folders["sharded"] / "model.safetensors.index.json")
    return {form: str(folder) for form, folder in folders.items()}


def from_pretrained(path, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.loss_type = "ForCausalLM"
    return model


def first_loss(model) -> float:
    x, _ = models.global_batch("hf_llama", 0)
    with torch.no_grad():
        return model(input_ids=x, labels=x).loss.item()


def load_rank(rank: int, world_size: int, path: str):
    """Stage 3: load into the shards of a meta Llama, measuring this rank's tensor memory."""
    from bench.helpers import cpu_memory

    # The counting allocator sits in front of c10's CPU allocator, so it sees every tensor
    # allocation, by zero_fx, torch or safetensors, whether or not it goes through Python
    # dispatch (a dispatch mode such as LiveTensorBytes or MemTracker sees only those that
    # do). What it does not count is the file's pages that safetensors memory-maps:
    # page cache, not memory this process allocated; LoadedWeights.bytes_read bounds them.
    cpu_memory.install()
    model = llama(meta=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zero_compile(models.training_step("hf_llama"), stage=3, backend="aot_eager")
    gc.collect()
    base = cpu_memory.allocated()
    cpu_memory.reset_peak()
    loaded = load_pretrained(step, path, model, opt)
    peak, held = cpu_memory.max_allocated() - base, cpu_memory.allocated() - base
    full = step.full_parameters()
    with step.gathered_parameters():
        loss = first_loss(model)
    plan = step.plan
    return {"peak": peak, "held": held, "loaded": loaded, "loss": loss,
            "params": full if rank == 0 else None,
            "shard_bytes": plan.shard_numel * 4, "model_bytes": plan.total_numel * 4,
            "largest_bytes": max(layout.numel for layout in plan.params) * 4,
            "row_bytes": sum(4 * layout.numel // layout.shape[0] for layout in plan.params),
            "buffer_bytes": sum(b.untyped_storage().nbytes() for b in model.buffers()),
            "inv_freq": model.model.rotary_emb.inv_freq}


@pytest.mark.parametrize("world_size, form", [(2, "sharded"), (4, "single")])
def test_llama_loads_into_shards_as_from_pretrained(saved, world_size, form):
    results = run_ranks(world_size, load_rank, saved[form])
    reference = from_pretrained(saved[form])
    expected = dict(reference.named_parameters())
    assert results[0]["params"].keys() == expected.keys()
    assert all(torch.equal(p, expected[name]) for name, p in results[0]["params"].items())
    assert all(r["loss"] == pytest.approx(first_loss(reference), abs=1e-6) for r in results)
    assert all(torch.equal(r["inv_freq"], reference.model.rotary_emb.inv_freq) for r in results)
    for rank, r in enumerate(results):
        # what a rank holds while loading: its shards (1/N of the model, padded) and one
        # tensor at a time besides, and the buffers every rank keeps whole (rotary inv_freq);
        # after: its shards and the buffers
        bound = r["shard_bytes"] + r["largest_bytes"] + r["buffer_bytes"]
        print(f"world {world_size} rank {rank}: loading peak {r['peak']:,} B = "
              f"{r['peak'] / r['model_bytes']:.3f} of the model ({r['model_bytes']:,} B; 1/N "
              f"+ the largest tensor = {bound / r['model_bytes']:.3f}); read "
              f"{r['loaded'].bytes_read:,} of {r['loaded'].file_bytes:,} B")
        assert r["peak"] <= bound, (rank, r["peak"], bound)
        assert r["held"] == r["shard_bytes"] + r["buffer_bytes"], (rank, r["held"], r["shard_bytes"])
        # only its rows of each tensor (a slice starts and ends within a row)
        assert r["loaded"].bytes_read <= r["loaded"].file_bytes / world_size + 2 * r["row_bytes"]


def test_a_model_loads_whole_as_from_pretrained(saved):
    """load_pretrained(model, path) without a step: like from_pretrained, into a meta model
    (materialized on the CPU) or in place into a model that has values."""
    reference = from_pretrained(saved["sharded"])
    for model in (llama(meta=True), llama()):
        loaded = load_pretrained(model, saved["sharded"])
        assert loaded.files > 1 and loaded.bytes_read == loaded.file_bytes
        assert all(torch.equal(p, dict(reference.named_parameters())[n])
                   for n, p in model.named_parameters())
        assert first_loss(model) == first_loss(reference)


def test_tied_and_bf16_weights_load_as_from_pretrained(tmp_path):
    """save_pretrained writes a tied embedding once; bf16 files load into an fp32 model."""
    torch.manual_seed(4)
    llama(tied=True).to(torch.bfloat16).save_pretrained(tmp_path)
    model = llama(tied=True, meta=True)
    load_pretrained(model, str(tmp_path))
    reference = from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(p, dict(reference.named_parameters())[n])
               for n, p in model.named_parameters())


def test_gpt2_loads_with_its_tie_and_computed_buffers(tmp_path):
    """GPT-2's files lack lm_head.weight (tied to wte) and its causal-mask buffers (computed in
    __init__, which on a meta model ran without values)."""
    torch.manual_seed(6)
    hf_models.tiny_gpt2(VOCAB, models.SEQ).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = hf_models.tiny_gpt2(VOCAB, models.SEQ)
    load_pretrained(model, str(tmp_path))
    reference = from_pretrained(str(tmp_path))
    assert model.lm_head.weight is model.transformer.wte.weight
    for mine, theirs in ((model.named_parameters(), reference.named_parameters()),
                         (model.named_buffers(), reference.named_buffers())):
        theirs = dict(theirs)
        assert all(torch.equal(t, theirs[name]) for name, t in mine)


def test_weights_that_do_not_fit_are_refused(saved, tmp_path):
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight .* has shape \[256, 64\], "
                                              r"the model's .* \[256, 32\]"):
        load_pretrained(llama(width=32, meta=True), saved["single"])
    with pytest.raises(CheckpointError, match=r"9 of the model's tensor\(s\) are not in the files "
                                              r"\(model.layers.2"):
        load_pretrained(llama(layers=3, meta=True), saved["single"])
    torch.manual_seed(5)
    extra = dict(llama().state_dict(), **{"rotary.inv_freq": torch.ones(4)})
    save_file({k: v.contiguous() for k, v in extra.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) in the files are not in the model "
                                              r"\(rotary.inv_freq\).*rename="):
        load_pretrained(llama(meta=True), str(tmp_path))
    model = llama(meta=True)  # rename maps a name, None skips it
    load_pretrained(model, str(tmp_path), rename={"rotary.inv_freq": None})
    assert torch.equal(model.lm_head.weight, extra["lm_head.weight"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors or "
                                                r"model.safetensors.index.json in .*save_pretrained"):
        load_pretrained(llama(meta=True), str(tmp_path / "empty"))


def test_a_step_loads_before_its_first_call_only(saved):
    model = llama(meta=True)
    opt = torch.optim.AdamW(model.parameters())
    step = zero_compile(models.training_step("hf_llama"), stage=3, backend="aot_eager")
    with pytest.raises(ValueError, match=r"needs the model and optimizer"):
        load_pretrained(step, saved["single"])
    load_pretrained(step, saved["single"], model, opt)
    with pytest.raises(RuntimeError, match=r"after train_step has sharded its model.*before the "
                                           r"first call"):
        load_pretrained(step, saved["single"], model, opt)
    with pytest.raises(RuntimeError, match=r"sharded by the compiled step 'train_step'"):
        load_pretrained(model, saved["single"])
