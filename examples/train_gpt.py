"""Train a small GPT on a synthetic corpus with ZeRO (stage 3 unless --stage says otherwise).

    torchrun --nproc_per_node 2 examples/train_gpt.py        # 2 CPU ranks over gloo
    python examples/train_gpt.py                             # one process, world size 1
    torchrun --nproc_per_node 2 examples/train_gpt.py --checkpoint-dir ckpt   # resumable

With --checkpoint-dir, a checkpoint is saved every --checkpoint-every steps and at the
end, and a run started again with the same folder resumes where the last one saved
(any world size, any stage): the same losses as a run that was never interrupted.
Under torchrun --max-restarts N, a rank that dies or hangs (past --timeout) restarts the
group, which resumes from the last checkpoint:

    torchrun --nproc_per_node 2 --max-restarts 2 examples/train_gpt.py --checkpoint-dir ckpt

With --hybrid, parameters are sharded within each node and replicated across nodes (a
2-D device mesh: one replica per node, torchrun's --nproc_per_node ranks per replica):

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29400 examples/train_gpt.py --hybrid    # on each node
"""

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPT, GPTConfig  # noqa: E402
from examples.launch import GROUP_TIMEOUT, add_device_argument, launch  # noqa: E402
from examples.progress import Progress  # noqa: E402
from examples.summary import StepClock, summary  # noqa: E402
from zero_fx import MixedPrecision, checkpoint_exists, zero_compile  # noqa: E402

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
parser.add_argument("--checkpoint-dir", default=None,
                    help="save checkpoints here, and resume from the one there if any")
parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
parser.add_argument("--hybrid", action="store_true",
                    help="shard within each node, replicate across nodes (2-D device mesh)")
parser.add_argument("--timeout", type=float, default=GROUP_TIMEOUT.total_seconds(),
                    help="seconds a rank waits at a collective for a dead or hung peer before failing")
add_device_argument(parser)
args = parser.parse_args()

# -- distributed setup (torchrun sets the environment; without it, world size 1) --
run = launch(timedelta(seconds=args.timeout), device=args.device)
rank, world, device, log = run.rank, run.world, run.device, run.log

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


# -- hybrid sharding: a (nodes, ranks per node) mesh; shards stay within a node ---------
mesh = None
if args.hybrid:
    from torch.distributed.device_mesh import init_device_mesh

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = init_device_mesh(device.type, (world // per_node, per_node),
                            mesh_dim_names=("replicate", "shard"))
    log(f"hybrid sharding: {world // per_node} replica(s) of {per_node} rank(s)")

# -- the training step: the one line where zero_fx plugs in ----------------------
precision = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]


@zero_compile(stage=args.stage, backend=args.backend, dump_dir=args.dump_dir,
              mixed_precision=MixedPrecision(param_dtype=precision, output_dtype=torch.float32)
              if precision else None,
              accumulation_steps=args.accumulation_steps, max_grad_norm=args.max_grad_norm,
              mesh=mesh)
def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# -- resume: the model, optimizer, RNG and our step counter, at any world size/stage --
checkpoint = os.path.join(args.checkpoint_dir, "latest") if args.checkpoint_dir else None
first_step = 0
if checkpoint and checkpoint_exists(checkpoint):
    first_step = train_step.load_checkpoint(checkpoint, model, opt)["step"]
    log(f"resumed from {checkpoint} after step {first_step}")


# -- training loop: the first step compiles, then a progress bar (a line per step in a log) --
clock, loss = StepClock(device), None  # waits for a GPU before reading the time
progress = Progress(args.steps, start=first_step, enabled=rank == 0)
for step in progress:  # one optimizer step: accumulation-steps calls
    clock.start()
    loss = 0.0
    for micro in range(args.accumulation_steps):
        x, y = get_batch(step * args.accumulation_steps + micro)
        loss += train_step(model, opt, x, y) / args.accumulation_steps
    loss = run.mean_over_ranks(loss)  # the mean over ranks is the loss of the global batch
    seconds = clock.stop()
    norm = train_step.last_grad_norm
    progress.update(f"loss {loss.item():.4f}  {1e3 * seconds:8.1f} ms"
                    + (f"  grad norm {norm.item():.3f}" if norm is not None else ""))
    if checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
        train_step.save_checkpoint(checkpoint, extra={"step": step + 1})
        progress.write(f"saved {checkpoint} after step {step + 1}")

# -- summary -------------------------------------------------------------------------
if loss is None:
    log(f"nothing to do: the checkpoint is at step {first_step} of {args.steps}")
else:
    log("\n" + summary(train_step, final_loss=loss.item(), clock=clock))
    log(f"(stage 0 would hold {3 * 4 * num_params / 2**20:.2f} MiB between steps)")
if args.explain and loss is not None:
    log(train_step.explain())
run.finish()
