"""Training runs shared by the parity and memory tests: zero_fx on N ranks, and the reference."""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref

import torch

from support import models
from bench.experiments.stages import measure_stages, rss_growth_during_step
from support.ranks import run_ranks, with_mesh
from zero_fx import zero_compile

STEPS = 5

UNSCHEDULED = (("bucket_bytes", 0), ("persistence_threshold", 0), ("prefetch", 0))
"""zero_compile options: one collective per parameter, each issued where it is used."""
SMALL_BUCKETS = (("bucket_bytes", 4096), ("persistence_threshold", 0), ("prefetch", 2))
"""Several buckets per phase in the test GPT, prefetched two ahead, nothing resident."""


class Frozen(dict):
    """A dict option value (``quantize_weights={"forward": ...}``) that can sit in the
    options tuple of a cached run (hashable; never changed)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))


def zero_fx_rank(rank: int, world_size: int, model_name: str, backend: str, optimizer: str,
                 stage: int = 3, broken: str = "", options: tuple = (), meta: bool = False):
    """Train STEPS steps with @zero_compile(stage=..., **dict(options)) on this rank's slice
    of each global batch; ``meta``: the model is built on the meta device (zero_fx
    initializes it, seeded as ``models.build`` seeds it)."""
    with _broken(broken):
        return _trained(rank, world_size, model_name, backend, optimizer, stage, options, meta)


@contextlib.contextmanager
def _broken(broken: str):
    """``"skip_divide"``: a deliberately broken reduce pass, to prove the parity test bites;
    put right afterwards (a rank serves later runs)."""
    if broken != "skip_divide":
        yield
        return
    import sys

    import zero_fx.passes  # noqa: F401  (the module, not the function of the same name)

    module = sys.modules["zero_fx.passes.common.collective_code"]
    average = module._average
    module._average = lambda summed, world_size: summed
    try:
        yield
    finally:
        module._average = average


def _trained(rank, world_size, model_name, backend, optimizer, stage, options, meta):
    # world size 1 runs in the test process, next to earlier runs' results
    alive_before = _live_tensors()
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = models.build(model_name)
    opt = models.make_optimizer(model, optimizer)

    train_step = zero_compile(models.training_step(model_name), stage=stage, backend=backend,
                              **with_mesh(dict(options)))

    losses, counted = _train(train_step, model, opt, model_name, rank, world_size, STEPS)
    memory = _held_memory(model, train_step, alive_before)  # before full_parameters() gathers copies
    return {
        "losses": losses,
        "params": train_step.full_parameters(),
        "memory": memory,
        "compile_seconds": train_step.compile_seconds,
        "traffic": train_step.traffic(),
        "counted": counted,
    }


def _train(train_step, model, opt, model_name, rank, world_size, steps) -> tuple[list, dict]:
    """``steps`` steps on this rank's slice of each global batch: the losses, and the
    collectives counted in the last step."""
    losses = []
    for step in range(steps):
        x, y = models.global_batch(model_name, step)
        per_rank = x.shape[0] // world_size
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        with train_step.counting_collectives() as counted:
            losses.append(train_step(model, opt, x[local], y[local]).item())
    return losses, {"numel": dict(counted.numel), "launches": dict(counted.launches)}


def counted_traffic_rank(rank: int, world_size: int, stage: int, options: tuple = ()) -> dict:
    """The test GPT's traffic report and the collectives counted in its second step (the
    first compiles), on this rank's slice of each global batch; nothing else measured."""
    model = models.build("gpt")
    opt = models.make_optimizer(model, "adamw")
    train_step = zero_compile(models.training_step("gpt"), stage=stage, backend=models.BACKEND,
                              **with_mesh(dict(options)))
    _, counted = _train(train_step, model, opt, "gpt", rank, world_size, steps=2)
    return {"traffic": train_step.traffic(), "counted": counted}


def checkpointed_training_rank(rank, world_size, stage, steps, load_from=None, save_to=None,
                               save_after=None, precision=None, model_name="gpt"):
    """Train the test GPT (AdamW) on this rank's slice of each global batch; optionally start
    from a checkpoint and save one after ``save_after`` steps."""
    model = models.build(model_name, seed=1)
    opt = models.make_optimizer(model)
    step = zero_compile(models.training_step(model_name), stage=stage, backend=models.BACKEND,
                        mixed_precision=precision)
    first = 0
    if load_from:
        first = step.load_checkpoint(load_from, model, opt)["next_step"]
    losses = {}
    for i in range(first, steps):
        if save_to and save_after == i:
            step.save_checkpoint(save_to, extra={"next_step": i})
        x, y = models.global_batch(model_name, i)
        losses[i] = step(model, opt, x[rank::world_size], y[rank::world_size]).item()
    if save_to and save_after == steps:
        step.save_checkpoint(save_to, extra={"next_step": steps})
    return {"losses": losses, "params": step.full_parameters(),
            "optimizer_steps": step.optimizer_steps, "loss_scale": step.loss_scale}


def _live_tensors() -> dict:
    gc.collect()
    return {id(obj): weakref.ref(obj)
            for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)}


def _held_memory(model, train_step, alive_before: dict) -> dict:
    """What this rank holds after a step, measured on the tensors themselves
    (those alive before the run began excluded)."""
    gc.collect()
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    # shards and optimizer state are full-shaped at world size 1; they are not what we look for
    # (nor, in stages 0-2, are the model's parameters)
    held = {t.untyped_storage().data_ptr() for t in train_step.state.held_tensors()}
    storages, full_size_alive = {}, []
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or isinstance(obj, torch._subclasses.FakeTensor):
            continue
        earlier = alive_before.get(id(obj))
        if obj.device.type == "meta" or (earlier is not None and earlier() is obj):
            continue
        storage = obj.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        if (tuple(obj.shape) in param_shapes and storage.data_ptr() not in held
                and storage.nbytes() >= obj.numel() * obj.element_size()):
            full_size_alive.append(tuple(obj.shape))
    state = train_step.state
    return {
        "full_param_storage_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters()),
        "shard_bytes": sum(s.untyped_storage().nbytes() for s in state.shards.values()),
        "optimizer_state_bytes": sum(
            v.untyped_storage().nbytes()
            for st in state.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        ),
        "all_live_tensor_bytes": sum(storages.values()),
        "full_size_parameters_alive": full_size_alive,
        "unsharded_numel": train_step.plan.total_numel,
        "shard_numel": train_step.plan.shard_numel,
    }


@functools.lru_cache(maxsize=None)
def zero_fx_run(world_size: int, model_name: str, backend: str, optimizer: str = "adamw",
                stage: int = 3, broken: str = "", options: tuple = (), meta: bool = False):
    return run_ranks(world_size, zero_fx_rank, model_name, backend, optimizer, stage, broken,
                     options, meta, shared=True)


@functools.lru_cache(maxsize=None)
def reference_run(model_name: str, optimizer: str = "adamw"):
    """Plain single-process PyTorch on the whole global batch."""
    model = models.build(model_name)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = models.make_optimizer(model, optimizer)
    losses = []
    for step in range(STEPS):
        x, y = models.global_batch(model_name, step)
        loss = models.loss_fn(model_name, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "initial": initial}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


UPDATE_TOLERANCE = 1e-3
"""Bound on each parameter's update error, ``‖p − p_ref‖ / ‖p_ref − p_0‖`` (shared/DESIGN's
parity invariant): a gradient a few percent off on a parameter that moves little (a router)
hides under the bound on the parameter itself, not under this one."""


def parity_errors(results: list, reference: dict,
                  update_tolerance: float = UPDATE_TOLERANCE) -> dict:
    """Worst relative error of the per-step mean loss and of each final parameter; and
    every parameter's update error checked: AssertionError naming the worst if it is above
    ``update_tolerance`` (``reference["initial"]``, the parameters before the first step,
    is required)."""
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    errors = {"loss": relative_error(mean_losses, torch.tensor(reference["losses"]))}
    for name, expected in reference["params"].items():
        for rank, r in enumerate(results):
            errors[f"{name}@rank{rank}"] = relative_error(r["params"][name], expected)
    check_updates(results, reference, update_tolerance)
    return errors


def update_errors(results: list, reference: dict) -> dict:
    """``{name@rank: ‖p − p_ref‖ / ‖p_ref − p_0‖}`` over the parameters the reference holds; a
    parameter the reference left where it was has its distance from ``p_0`` instead."""
    errors = {}
    for name, expected in reference["params"].items():
        start = reference["initial"][name]
        for rank, r in enumerate(results):
            errors[f"{name}@rank{rank}"] = update_error(r["params"][name], expected, start)
    return errors


def update_error(actual: torch.Tensor, expected: torch.Tensor, initial: torch.Tensor) -> float:
    actual, expected, initial = (t.detach().float() for t in (actual, expected, initial))
    moved = (expected - initial).norm()
    if moved == 0:
        return (actual - initial).norm().item()
    return ((actual - expected).norm() / moved).item()


def check_updates(results: list, reference: dict, tolerance: float = UPDATE_TOLERANCE) -> dict:
    """AssertionError naming the parameter whose update is furthest off if it is above
    ``tolerance``; the errors otherwise."""
    errors = update_errors(results, reference)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, (
        f"the update of {worst} is {errors[worst]:.2e} off the reference's, relative to "
        f"the update (bound {tolerance:.0e})")
    return errors



@functools.lru_cache(maxsize=None)
def peak_memory_run(world_size: int, stages: tuple, width: int, depth: int):
    """Per rank, per stage: the measurements of bench/experiments/stages.py (the note's table)."""
    return run_ranks(world_size, measure_stages, stages, width, depth)


@functools.lru_cache(maxsize=None)
def rss_growth_run(world_size: int, stage: int, backend: str, width: int, depth: int,
                   options: tuple = ()):
    """Per rank: resident memory growth during a step (the ranks inherit os.environ)."""
    return run_ranks(world_size, rss_growth_during_step, stage, backend, width, depth, options,
                     fresh_interpreter=True)  # MALLOC_* are read when a process starts


def update_errors_against_eager(model, step_fn, batches, **options) -> tuple:
    """Each parameter's update error (``update_errors``), and the compiled step, after ``step_fn`` trains ``model``
    under ``zero_compile(step_fn, backend="aot_eager", on_graph_break="error", **options)``
    and a copy of it eagerly, SGD at 0.1, one step per ``batches`` item (the step's
    arguments after the model and optimizer)."""
    import copy

    eager = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager))
    step = zero_compile(step_fn, backend="aot_eager", on_graph_break="error", **options)
    for batch in batches:
        step(model, opt, *batch)
        step_fn(eager, eager_opt, *batch)
    return update_errors([{"params": step.full_parameters()}],
                         {"params": dict(eager.named_parameters()), "initial": initial}), step


def regression_batches(width: int, outputs: int, steps: int = 3, rows: int = 16) -> list:
    """``steps`` seeded (x, y) pairs of random regression data."""
    generators = [torch.Generator().manual_seed(i) for i in range(steps)]
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, outputs, generator=g))
            for g in generators]


def assert_computes_the_same(model, reference, x) -> None:
    """``model`` and ``reference`` (the same weights) give the same output on ``x`` and the
    same gradients of every parameter under a squared-sum loss."""
    for m in (model, reference):
        m(x).square().sum().backward()
    assert torch.allclose(model(x), reference(x), atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
