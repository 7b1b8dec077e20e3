"""Train a small GPT on a synthetic corpus with ZeRO (stage 3 unless --stage says otherwise).

    torchrun --nproc_per_node 2 examples/train_gpt.py        # 2 CPU ranks over gloo
    python examples/train_gpt.py                             # one process, world size 1
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zero_fx import MixedPrecision, zero_compile  # noqa: E402

# -- arguments ------------------------------------------------------------------
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over ranks")
parser.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager")
parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3],
                    help="0 = DDP, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters")
parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="bf16/fp16: compute and all-gather in 16 bits, fp32 masters (fp16 scales the loss)")
parser.add_argument("--accumulation-steps", type=int, default=1,
                    help="micro-batches (calls of the step) per optimizer step")
parser.add_argument("--max-grad-norm", type=float, default=None, help="clip the gradient to this norm")
parser.add_argument("--explain", action="store_true",
                    help="print what zero_fx did: plan, collectives, gathered lifetimes, memory")
parser.add_argument("--dump-dir", default=None,
                    help="write the graph before/after each pass (text, HTML) and a memory plot here")
args = parser.parse_args()

# -- distributed setup (torchrun sets the environment; without it, world size 1) --
if "RANK" in os.environ:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank() if dist.is_initialized() else 0
world = dist.get_world_size() if dist.is_initialized() else 1
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
log = print if rank == 0 else (lambda *a, **k: None)

# -- data: a synthetic corpus with structure to learn (repeating arithmetic patterns) --
cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=128)
g = torch.Generator().manual_seed(0)
starts = torch.randint(0, cfg.vocab_size, (4096, 1), generator=g)
strides = torch.randint(1, 4, (4096, 1), generator=g)
corpus = (starts + strides * torch.arange(cfg.block_size + 1)) % cfg.vocab_size
assert args.batch_size % world == 0, "the global batch must split evenly over ranks"
local_batch = args.batch_size // world


def get_batch(call):
    rows = torch.randint(0, len(corpus), (args.batch_size,), generator=torch.Generator().manual_seed(call))
    rows = rows[rank * local_batch:(rank + 1) * local_batch]  # this rank's slice of the global batch
    seq = corpus[rows].to(device)
    return seq[:, :-1], seq[:, 1:]


# -- model and optimizer: plain PyTorch ----------------------------------------
torch.manual_seed(0)
model = GPT(cfg).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
num_params = model.num_params()
log(f"GPT with {num_params / 1e6:.2f}M parameters, stage {args.stage}, {world} rank(s), "
    f"backend {args.backend}")


# -- the training step: the one line where zero_fx plugs in ----------------------
precision = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]


@zero_compile(stage=args.stage, backend=args.backend, dump_dir=args.dump_dir,
              mixed_precision=MixedPrecision(param_dtype=precision, output_dtype=torch.float32)
              if precision else None,
              accumulation_steps=args.accumulation_steps, max_grad_norm=args.max_grad_norm)
def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# -- training loop -----------------------------------------------------------------
times = []
for step in range(args.steps):  # one optimizer step: accumulation-steps calls, a micro-batch each
    start = time.perf_counter()
    loss = 0.0
    for micro in range(args.accumulation_steps):
        x, y = get_batch(step * args.accumulation_steps + micro)
        loss += train_step(model, opt, x, y) / args.accumulation_steps
    if dist.is_initialized():  # the mean loss over ranks is the loss of the global batch
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss /= world
    times.append(time.perf_counter() - start)
    norm = train_step.last_grad_norm
    log(f"step {step + 1:3d}/{args.steps}  loss {loss.item():.4f}  {1e3 * times[-1]:8.1f} ms"
        + (f"  grad norm {norm.item():.3f}" if norm is not None else ""))

# -- summary -------------------------------------------------------------------------
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in train_step.state.held_tensors()}
held = sum(storages.values())
steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
log(f"\ndone: final loss {loss.item():.4f}")
log(f"compile (capture + passes + {args.backend}): {sum(train_step.compile_seconds):.1f} s; "
    f"median step after the first: {1e3 * steady:.1f} ms")
log(f"rank 0 holds {held / 2**20:.2f} MiB of parameters, shards and optimizer state between "
    f"steps (stage 0 would hold {3 * 4 * num_params / 2**20:.2f} MiB)")
log(f"traffic per step: {train_step.traffic().summary()}")
if args.explain:
    log(train_step.explain())
if dist.is_initialized():
    dist.destroy_process_group()
