"""LoRA-style fine-tuning with ZeRO: a frozen GPT base, trainable low-rank adapters.

    torchrun --nproc_per_node 2 examples/lora.py          # 2 CPU ranks, stage 3
    torchrun --nproc_per_node 2 examples/lora.py --lora-rank 4 --adapter-path adapter.pt

Every linear layer of the blocks gets ``W x + B A x`` with A (rank r x in) and B (out x r)
trainable and W frozen. zero_fx then steps, reduces and keeps optimizer state for the
adapters only; in stage 3 the frozen base stays sharded (1/N per rank) and is gathered
where used, but its gradients are never computed or reduced. The closing lines show it:
the reduce-scatter carries the adapters' elements only, and the base is bitwise unchanged.

At the end the adapters alone are saved (--adapter-path): a small file of their weights,
by name (``torch.save``; ``load_adapter`` reads it into a model with adapters). The base is
whatever it was before training: only the adapters need keeping.
"""

import argparse
import os
import sys
import warnings

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
parser.add_argument("--lora-rank", type=int, default=8, help="the adapters' rank r")
parser.add_argument("--rank", type=int, dest="old_lora_rank", default=None,
                    help=argparse.SUPPRESS)  # the old name, which read as the process rank
parser.add_argument("--adapter-path", default="lora_adapter.pt",
                    help="where to save the trained adapters (their weights only) at the end")
add_device_argument(parser)
args = parser.parse_args()
run = launch(device=args.device)
if args.old_lora_rank is not None:
    if run.rank == 0:
        warnings.warn("lora.py: --rank is renamed --lora-rank (it read as the process rank); "
                      "--rank goes in the next release", FutureWarning, stacklevel=1)
    args.lora_rank = args.old_lora_rank


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


def adapter_state(parameters: dict) -> dict:
    """The adapters' weights of a ``{name: tensor}`` of the model (``down`` and ``up``)."""
    return {name: t for name, t in parameters.items()
            if name.endswith((".down.weight", ".up.weight"))}


def load_adapter(model: nn.Module, path: str) -> None:
    """Put the adapters saved at ``path`` into ``model`` (the base with adapters of that rank)."""
    result = model.load_state_dict(torch.load(path, weights_only=True)["weights"], strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{path} holds adapters this model lacks: {result.unexpected_keys[:3]}")


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
model = add_adapters(GPT(cfg), args.lora_rank).to(run.device)
base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
trainable = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)  # the adapters only
total = sum(p.numel() for p in model.parameters())
run.log(f"GPT with {total / 1e6:.2f}M parameters, {sum(p.numel() for p in trainable) / 1e6:.3f}M "
        f"of them trainable (rank-{args.lora_rank} adapters), stage {args.stage}, {run.world} rank(s)")


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

# -- the adapters alone: the small file worth keeping (the base did not change) ------------
adapters = adapter_state(after)
if run.rank == 0:
    torch.save({"lora_rank": args.lora_rank, "weights": {n: t.cpu() for n, t in adapters.items()}},
               args.adapter_path)
    run.log(f"saved the adapters to {args.adapter_path}: {len(adapters)} tensors, "
            f"{sum(t.numel() for t in adapters.values()):,} parameters, "
            f"{os.path.getsize(args.adapter_path) / 2**10:.1f} KiB (the whole model: "
            f"{sum(t.numel() * t.element_size() for t in after.values()) / 2**10:.1f} KiB)")
run.finish()
