"""Check zero_fx against eager PyTorch on a model before training it: the README's model and
step, ``zero_fx.verify`` before the first call, then a few steps of training.

    torchrun --standalone --nproc_per_node 2 examples/verify_step.py
    python examples/verify_step.py                   # one process, world size 1

``verify`` trains a copy of the model under the step's options and another copy eagerly
with the gradients averaged over the ranks, and prints each parameter's update error, worst
first (docs/troubleshooting.md, "Checking zero_fx on your model"). SGD, not AdamW: Adam's
first steps are nearly blind to the scale of a gradient, so a gradient 5% off would hide.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_fx
from zero_fx import zero_compile

run = zero_fx.init_distributed()        # torchrun: joins the group; plain python: one process
torch.manual_seed(0)                    # the same initial weights on every rank
model = nn.Sequential(nn.Embedding(256, 128), nn.Linear(128, 512), nn.GELU(),
                      nn.Linear(512, 256)).to(run.device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@zero_compile(stage=3, backend="aot_eager")
def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


data = torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(1))
rows = data[:8][run.rank::run.world_size].to(run.device)   # this rank's share of 8 sequences
report = zero_fx.verify(train_step, model, opt, rows[:, :-1], rows[:, 1:], steps=2)
if run.is_main:
    print(report)
if not report.ok:
    raise SystemExit(1)

for step in range(5):                   # the step itself was left untouched: train as usual
    rows = data[torch.arange(8 * step, 8 * step + 8) % 64][run.rank::run.world_size]
    loss = train_step(model, opt, rows[:, :-1].to(run.device), rows[:, 1:].to(run.device))
if run.is_main:
    print(f"the step itself then trained 5 steps (last loss {loss.item():.3f})")

if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
