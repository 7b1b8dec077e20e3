"""Steps dynamo cannot trace as one graph still train: an RNN is traced into the graph
(``allow_rnn``), and a step that breaks it (a branch on the loss's value) runs eagerly on
the sharded state ([Note: eager sharded execution] in zero_fx/runtime/eager_fallback.py),
at parity with eager, with a warning once and ``explain()`` naming the line; with
``on_graph_break="error"`` it raises instead. One launch of 2 ranks holds every 2-rank
case."""

import copy
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from support.ranks import run_ranks
from support.training import check_updates, relative_error
from zero_fx import CaptureError, GraphBreakWarning, zero_compile

STEPS = 5
THRESHOLD = 1.0
"""Between the losses of the small-target and the large-target batches: the branch is
taken on some steps and not on others."""
SCALES = ((0.1, 0.1), (3.0, 3.0), (0.1, 0.1), (3.0, 0.1), (3.0, 3.0))
"""Each step's target scale on the first and the second half of the global batch: on the
fourth, a 2-rank step takes the branch on rank 0 only."""


def branching_step(model, opt, x, y):
    loss = ((model(x) - y) ** 2).mean()
    if loss > THRESHOLD:  # the graph break the tests name
        loss = loss * 0.5
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


BREAK_LINE = (inspect.getsourcelines(branching_step)[1]
              + next(i for i, line in enumerate(inspect.getsource(branching_step).splitlines())
                     if "if loss > THRESHOLD" in line))


def lstm_step(model, opt, x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


class Recurrent(nn.Module):
    """A linear layer, an LSTM, a GRU and a head: the RNN modules dynamo refuses by default."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h, _ = self.lstm(torch.tanh(self.inp(x)))
        h, _ = self.gru(h)
        return self.head(h[:, -1])


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def _recurrent():
    torch.manual_seed(0)
    return Recurrent()


def _regression_batch(step):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=generator)
    y = torch.randn(8, 2, generator=generator)
    first, second = SCALES[step]
    return x, torch.cat([y[:4] * first, y[4:] * second])


def _sequence_batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _train(rank, world_size, make_model, batch, body, steps=STEPS, **options):
    """``steps`` calls of ``@zero_compile(body, **options)`` on this rank's slice of each
    global batch: losses, parameters, the warnings it gave, explain(), compilations."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = zero_compile(body, backend="aot_eager", **options)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            x, y = batch(i)
            per_rank = x.shape[0] // world_size
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            losses.append(step(model, opt, x[mine], y[mine]).item())
    return {"losses": losses, "params": step.full_parameters(), "explain": str(step.explain()),
            "breaks": sum(issubclass(w.category, GraphBreakWarning) for w in caught),
            "warned_at": {os.path.basename(w.filename) for w in caught
                          if issubclass(w.category, GraphBreakWarning)},
            "compilations": len(step.compilations)}


def _reference(make_model, batch, body_loss, world_size, steps=STEPS, accumulation=1,
               max_grad_norm=None):
    """Plain PyTorch in one process: each rank's slice's loss as its step computes it (the
    branch taken per slice), their mean backpropagated, as DDP's gradient is."""
    model = make_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for i in range(steps):
        x, y = batch(i)
        per_rank = x.shape[0] // world_size
        parts = [body_loss(model, x[r * per_rank:(r + 1) * per_rank],
                           y[r * per_rank:(r + 1) * per_rank]) for r in range(world_size)]
        (sum(parts) / (world_size * accumulation)).backward()
        losses.append(sum(p.item() for p in parts) / world_size)
        if (i + 1) % accumulation == 0:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "initial": initial,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _branch_loss(model, x, y):
    loss = ((model(x) - y) ** 2).mean()
    return loss * 0.5 if loss > THRESHOLD else loss


def _lstm_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


CASES = {
    "branch stage 1": dict(stage=1),
    "branch stage 3": dict(stage=3),
    "branch stage 1 accumulated and clipped": dict(stage=1, accumulation_steps=2,
                                                   max_grad_norm=0.5),
}


def cases_rank(rank, world_size):
    """Every case of this module on one launch of ranks."""
    results = {name: _train(rank, world_size, _mlp, _regression_batch, branching_step, **options)
               for name, options in CASES.items()}
    if world_size > 1:
        results["lstm stage 3"] = _train(rank, world_size, _recurrent, _sequence_batch,
                                         lstm_step, stage=3)
        results["breaks on rank 0 only"] = _break_on_rank_zero_only(rank)
    return results


def _break_on_rank_zero_only(rank):
    """Rank 0 breaks the graph (its step branches on the loss), rank 1 captures it: the
    error each rank raises (RanksDisagreeError, not a hang)."""
    def step_fn(model, opt, x, y):
        loss = ((model(x) - y) ** 2).mean()
        if rank == 0 and loss > THRESHOLD:
            loss = loss * 0.5
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model = _mlp()
    step = zero_compile(step_fn, stage=3, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _regression_batch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        try:
            step(model, opt, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])
        except Exception as err:
            return f"{type(err).__name__}: {err}"
    return "no error"


def _check(results, reference):
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    assert relative_error(mean_losses, torch.tensor(reference["losses"])) < 1e-5
    for name, expected in reference["params"].items():
        for r in results:
            assert relative_error(r["params"][name], expected) < 1e-5, name
    check_updates(results, reference)


def _check_world(world_size, ranks):
    for name, options in CASES.items():
        results = [r[name] for r in ranks]
        reference = _reference(_mlp, _regression_batch, _branch_loss, world_size,
                               accumulation=options.get("accumulation_steps", 1),
                               max_grad_norm=options.get("max_grad_norm"))
        _check(results, reference)
        for r in results:
            assert r["breaks"] == 1, (name, r["breaks"])  # the warning, once per step
            assert r["warned_at"] == {"test_graph_breaks.py"}  # at the caller's line
            assert f"test_graph_breaks.py:{BREAK_LINE}" in r["explain"], r["explain"]
            assert "if loss > THRESHOLD" in r["explain"]
            assert r["compilations"] == 0


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, cases_rank)


def test_a_branch_on_the_loss_trains_eagerly_at_parity_on_one_rank():
    _check_world(1, run_ranks(1, cases_rank))


def test_a_branch_on_the_loss_trains_eagerly_at_parity_on_two_ranks(two_ranks):
    """The fourth step takes the branch on rank 0 only: the ranks' collectives do not
    depend on it, and the gradient is DDP's (each rank's own loss)."""
    _check_world(2, two_ranks)


def test_an_lstm_and_a_gru_train_in_one_graph_at_stage_3(two_ranks):
    results = [r["lstm stage 3"] for r in two_ranks]
    _check(results, _reference(_recurrent, _sequence_batch, _lstm_loss, 1))
    for r in results:
        assert r["breaks"] == 0 and r["compilations"] == 1
        assert "breaks the graph" not in r["explain"]


def test_tracing_with_onednn_off_prints_no_warning_of_torchs():
    """[Note: RNNs in the step]: oneDNN is off while tracing, and only it: switching it with
    ``torch.backends.mkldnn.flags`` wrote TF32's flag back too, and torch warned "TF32
    acceleration on top of oneDNN is available for Intel GPUs" at every user's first call."""
    code = ("import torch, warnings\n"
            "warnings.simplefilter('always')\n"
            "from zero_fx import zero_compile\n"
            "model = torch.nn.LSTM(4, 4)\n"
            "opt = torch.optim.AdamW(model.parameters())\n"
            "@zero_compile(stage=0, backend='eager')\n"
            "def step(model, opt, x):\n"
            "    loss = model(x)[0].sum()\n"
            "    loss.backward()\n"
            "    opt.step()\n"
            "    opt.zero_grad()\n"
            "    return loss\n"
            "step(model, opt, torch.randn(3, 2, 4))\n"
            "assert torch.backends.mkldnn.enabled\n"
            "print('stepped')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "stepped" in run.stdout, run.stderr[-3000:]
    assert "TF32" not in run.stderr, run.stderr[-3000:]


def test_on_graph_break_error_raises_naming_the_line():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    step = zero_compile(branching_step, stage=3, backend="aot_eager", on_graph_break="error")
    x, y = _regression_batch(0)
    with pytest.raises(CaptureError, match=rf"test_graph_breaks.py:{BREAK_LINE}: if loss > "):
        step(model, opt, x, y)
    with pytest.raises(ValueError, match="on_graph_break"):
        zero_compile(branching_step, on_graph_break="fallback")


def test_an_error_in_the_step_is_raised_not_hidden_by_the_fallback():
    """A failure that is not a graph break raises: our own CaptureError on the step's shape
    (no opt.step()), even once the step runs eagerly."""
    def no_optimizer_step(model, opt, x, y):
        loss = ((model(x) - y) ** 2).mean()
        if loss > THRESHOLD:
            loss = loss * 0.5
        loss.backward()
        opt.zero_grad()
        return loss

    model = _mlp()
    step = zero_compile(no_optimizer_step, stage=1, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphBreakWarning)
        with pytest.raises(CaptureError, match=r"opt.step\(\) 0 times"):
            step(model, torch.optim.AdamW(model.parameters()), *_regression_batch(0))


def test_a_break_on_some_ranks_only_fails_every_rank_instead_of_hanging(two_ranks):
    """The rank running eagerly tells the others before its first collective ([Note:
    checking that ranks agree])."""
    errors = [r["breaks on rank 0 only"] for r in two_ranks]
    for error in errors:
        assert error.startswith("RanksDisagreeError"), errors
        assert "runs eagerly after a graph break" in error and "rank 1 differs" in error, error
