"""LoRA-style fine-tuning with ZeRO: a frozen GPT base, trainable low-rank adapters.

    torchrun --nproc_per_node 2 examples/lora.py          # 2 CPU ranks, stage 3

Every linear layer of the blocks gets ``W x + B A x`` with A (rank r x in) and B (out x r)
trainable and W frozen. zero_fx then steps, reduces and keeps optimizer state for the
adapters only; in stage 3 the frozen base stays sharded (1/N per rank) and is gathered
where used, but its gradients are never computed or reduced. The closing lines show it:
the reduce-scatter carries the adapters' elements only, and the base is bitwise unchanged.
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.launch import add_device_argument, launch  # noqa: E402
from examples.progress import Progress  # noqa: E402
from examples.summary import StepClock, summary  # noqa: E402
from zero_fx import zero_compile  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over ranks")
parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
parser.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager")
parser.add_argument("--rank", type=int, default=8, help="the adapters' rank r")
add_device_argument(parser)
args = parser.parse_args()
run = launch(device=args.device)


class LoRALinear(nn.Module):
    """``base(x) + up(down(x)) * scale``; ``up`` starts at zero, so training starts from the base."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.up(self.down(x)) * self.scale


def add_adapters(model: nn.Module, rank: int) -> nn.Module:
    """Freeze everything, then wrap each block's linear layers in a LoRALinear."""
    model.requires_grad_(False)
    for block in model.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, rank))
    return model


# -- the same synthetic corpus as train_gpt.py ----------------------------------------
cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=128)
g = torch.Generator().manual_seed(0)
starts = torch.randint(0, cfg.vocab_size, (4096, 1), generator=g)
strides = torch.randint(1, 4, (4096, 1), generator=g)
corpus = (starts + strides * torch.arange(cfg.block_size + 1)) % cfg.vocab_size
assert args.batch_size % run.world == 0, "the global batch must split evenly over ranks"
local_batch = args.batch_size // run.world


def get_batch(step):
    rows = torch.randint(0, len(corpus), (args.batch_size,), generator=torch.Generator().manual_seed(step))
    seq = corpus[rows[run.rank * local_batch:(run.rank + 1) * local_batch]].to(run.device)
    return seq[:, :-1], seq[:, 1:]


torch.manual_seed(0)
model = add_adapters(GPT(cfg), args.rank).to(run.device)
base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
trainable = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)  # the adapters only
total = sum(p.numel() for p in model.parameters())
run.log(f"GPT with {total / 1e6:.2f}M parameters, {sum(p.numel() for p in trainable) / 1e6:.3f}M "
        f"of them trainable (rank-{args.rank} adapters), stage {args.stage}, {run.world} rank(s)")


@zero_compile(stage=args.stage, backend=args.backend)
def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


clock, loss = StepClock(run.device), None  # waits for a GPU before reading the time
progress = Progress(args.steps, enabled=run.rank == 0)
for step in progress:  # the first step compiles; then a progress bar (a line per step in a log)
    clock.start()
    loss = run.mean_over_ranks(train_step(model, opt, *get_batch(step)))
    seconds = clock.stop()
    progress.update(f"loss {loss.item():.4f}  {1e3 * seconds:8.1f} ms")

after = train_step.full_parameters()  # a collective: every rank
unchanged = all(torch.equal(after[n], p) for n, p in base_before.items())
reduced = sum(train_step.traffic().numel_by_kind().get(k, 0) for k in ("reduce_scatter", "all_reduce"))
run.log("\n" + summary(train_step, final_loss=loss.item(), clock=clock))
run.log(f"gradient reduction per step: {reduced:,} elements (the adapters: "
        f"{sum(p.numel() for p in trainable):,} parameters); frozen base unchanged: {unchanged}")
run.finish()
