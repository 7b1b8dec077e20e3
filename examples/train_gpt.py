"""Train a small GPT on a text file with ZeRO (stage 3 unless --stage says otherwise).

    torchrun --nproc_per_node 2 examples/train_gpt.py        # 2 CPU ranks over gloo
    python examples/train_gpt.py                             # one process, world size 1
    torchrun --nproc_per_node 2 examples/train_gpt.py --checkpoint-dir ckpt   # resumable
    torchrun --nproc_per_node 2 examples/train_gpt.py --data my.txt --layers 6 --width 256 \
        --heads 8 --seq 128 --steps 2000 --lr 1e-3 --warmup-steps 100 --eval-every 200

The text (--data; by default examples/data/shakespeare.txt) is read byte by byte: a
vocabulary of 256, no tokenizer. Its last --val-fraction is held out: every --eval-every
steps, and at the end, the loss on it is printed beside the training loss. The learning
rate warms up linearly for --warmup-steps, then decays along a cosine to a tenth of --lr
at --decay-steps (by default --steps). Each step prints its loss, learning rate, time and
tokens per second; --seed picks the initial weights and the batches.

With --checkpoint-dir, a checkpoint is saved every --checkpoint-every steps and at the
end, and a run started again with the same folder resumes where the last one saved
(any world size, any stage): the same losses as a run that was never interrupted. The
learning-rate schedule is part of the checkpoint (its position and its settings), so a
resumed run continues the schedule it was saved with.
Under torchrun --max-restarts N, a rank that dies or hangs (past --timeout) restarts the
group, which resumes from the last checkpoint:

    torchrun --nproc_per_node 2 --max-restarts 2 examples/train_gpt.py --checkpoint-dir ckpt

With --hybrid, parameters are sharded within each node and replicated across nodes (a
2-D device mesh: one replica per node, torchrun's --nproc_per_node ranks per replica):

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29400 examples/train_gpt.py --hybrid    # on each node
"""

import argparse
import math
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
from zero_fx import DebugOptions, MixedPrecision, checkpoint_exists, zero_compile  # noqa: E402

# -- arguments ------------------------------------------------------------------
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare.txt")
parser = argparse.ArgumentParser()
parser.add_argument("--data", default=DATA, help="a text file, read byte by byte (vocabulary 256)")
parser.add_argument("--val-fraction", type=float, default=0.1,
                    help="the end of the file held out for evaluation")
parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
parser.add_argument("--width", type=int, default=128, help="embedding width")
parser.add_argument("--heads", type=int, default=4, help="attention heads (divide --width)")
parser.add_argument("--seq", type=int, default=32, help="tokens (bytes) per sequence")
parser.add_argument("--steps", type=int, default=30, help="optimizer steps to train for")
parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over ranks")
parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
parser.add_argument("--warmup-steps", type=int, default=5,
                    help="steps of linear warmup to --lr, then a cosine decay")
parser.add_argument("--decay-steps", type=int, default=None,
                    help="the step where the cosine reaches --lr / 10 and stays (default: --steps)")
parser.add_argument("--seed", type=int, default=0, help="initial weights and batches")
parser.add_argument("--eval-every", type=int, default=10,
                    help="steps between held-out evaluations (0: only at the end)")
parser.add_argument("--eval-batches", type=int, default=4,
                    help="global batches of held-out text per evaluation")
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

# -- data: the file's bytes are the tokens; the last --val-fraction is held out -------
with open(args.data, "rb") as f:
    text = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)  # one byte a token
split = int(len(text) * (1 - args.val_fraction))
train_text, val_text = text[:split], text[split:]
if min(len(train_text), len(val_text)) <= args.seq:
    parser.error(f"{args.data}: {len(text):,} bytes leave too little text to train and evaluate "
                 f"on sequences of {args.seq} (--seq, --val-fraction)")
if args.width % args.heads:
    parser.error(f"--heads {args.heads} must divide --width {args.width}")
cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                n_embd=args.width)
if args.batch_size % world:
    parser.error(f"--batch-size {args.batch_size} must split evenly over {world} ranks")
local_batch = args.batch_size // world


def windows(source, starts):
    """This rank's slice of a global batch of windows: inputs, and targets one byte on."""
    starts = starts[rank * local_batch:(rank + 1) * local_batch]
    seq = torch.stack([source[s:s + args.seq + 1] for s in starts.tolist()]).long().to(device)
    return seq[:, :-1], seq[:, 1:]


def get_batch(call):
    """Random windows of the training text, the same for a call number on every run."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + call)
    return windows(train_text, torch.randint(0, len(train_text) - args.seq, (args.batch_size,),
                                              generator=g))


def eval_batches():
    """Evenly spaced windows of the held-out text: the same ones at every evaluation."""
    count = args.eval_batches * args.batch_size
    starts = torch.linspace(0, len(val_text) - args.seq - 1, count).long()
    return [windows(val_text, starts[i * args.batch_size:(i + 1) * args.batch_size])
            for i in range(args.eval_batches)]


# -- model and optimizer: plain PyTorch ----------------------------------------
torch.manual_seed(args.seed)
model = GPT(cfg).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
num_params = model.num_params()
log(f"GPT with {num_params / 1e6:.2f}M parameters ({args.layers} layers, width {args.width}, "
    f"{args.heads} heads, {args.seq} tokens), stage {args.stage}, {world} rank(s), backend "
    f"{args.backend}; {len(train_text):,} bytes of {os.path.basename(args.data)} to train on, "
    f"{len(val_text):,} held out")


# -- learning rate: linear warmup, then cosine decay (an object, so the checkpoint keeps it) --
class WarmupCosine:
    """The factor of the peak rate at optimizer step ``step`` (from 0): ``(step + 1) / warmup``
    while warming up, then a cosine from 1 down to ``floor`` at ``decay_steps``, then ``floor``.

    LambdaLR's state_dict saves a callable object's attributes (not a function's), so the
    checkpoint holds the schedule's settings as well as its position."""

    def __init__(self, warmup: int, decay_steps: int, floor: float = 0.1):
        self.warmup, self.decay_steps, self.floor = warmup, decay_steps, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step >= self.decay_steps:
            return self.floor
        done = (step - self.warmup) / max(1, self.decay_steps - self.warmup)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * done))


schedule = WarmupCosine(args.warmup_steps, args.decay_steps or args.steps)
scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)


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


@zero_compile(stage=args.stage, backend=args.backend,
              mixed_precision=MixedPrecision(param_dtype=precision, output_dtype=torch.float32)
              if precision else None,
              accumulation_steps=args.accumulation_steps, max_grad_norm=args.max_grad_norm,
              mesh=mesh, debug=DebugOptions(dump_dir=args.dump_dir))
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
    asked = dict(vars(schedule), lr=args.lr)
    extra = train_step.load_checkpoint(checkpoint, model, opt)
    first_step = extra["step"]
    if "scheduler" in extra:  # the schedule's position and settings, as saved
        scheduler.load_state_dict(extra["scheduler"])
    log(f"resumed from {checkpoint} after step {first_step}")
    saved = dict(vars(schedule), lr=scheduler.base_lrs[0])
    if saved != asked:
        log(f"the learning-rate schedule continues as saved ({saved}), not as this run's flags "
            f"ask ({asked})")


@torch.no_grad()
def evaluate() -> float:
    """The mean loss on the held-out batches, over every rank (the model runs outside the
    step: in stage 3 its parameters are gathered for the block, on every rank)."""
    with train_step.gathered_parameters():
        losses = [F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
                  for x, y in eval_batches()]
    return run.mean_over_ranks(torch.stack(losses).mean()).item()


# -- training loop: the first step compiles, then a progress bar (a line per step in a log) --
tokens_per_step = args.batch_size * args.accumulation_steps * args.seq  # over all ranks
clock, loss = StepClock(device), None  # waits for a GPU before reading the time
progress = Progress(args.steps, start=first_step, enabled=rank == 0)
for step in progress:  # one optimizer step: accumulation-steps calls
    lr = scheduler.get_last_lr()[0]
    clock.start()
    loss = 0.0
    for micro in range(args.accumulation_steps):
        x, y = get_batch(step * args.accumulation_steps + micro)
        loss += train_step(model, opt, x, y) / args.accumulation_steps
    loss = run.mean_over_ranks(loss)  # the mean over ranks is the loss of the global batch
    seconds = clock.stop()
    scheduler.step()  # the rate of the next optimizer step: never recompiles
    norm = train_step.last_grad_norm
    progress.update(f"loss {loss.item():.4f}  lr {lr:.2e}  {1e3 * seconds:8.1f} ms  "
                    f"{tokens_per_step / seconds:9,.0f} tok/s"
                    + (f"  grad norm {norm.item():.3f}" if norm is not None else ""))
    if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
        progress.write(f"step {step + 1}: held-out loss {evaluate():.4f} (training loss "
                       f"{loss.item():.4f})")
    if checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
        train_step.save_checkpoint(checkpoint, extra={"step": step + 1,
                                                      "scheduler": scheduler.state_dict()})
        progress.write(f"saved {checkpoint} after step {step + 1}")

# -- summary -------------------------------------------------------------------------
if loss is None:
    log(f"nothing to do: the checkpoint is at step {first_step} of {args.steps}")
else:
    held_out = evaluate()
    log("\n" + summary(train_step, final_loss=loss.item(), clock=clock))
    steady = clock.seconds[1:] or clock.seconds  # the first step compiles
    throughput = tokens_per_step * len(steady) / sum(steady)
    log(f"held-out loss {held_out:.4f}; throughput {throughput:,.0f} tokens/s over all ranks "
        f"(steps after the first)")
    log(f"(stage 0 would hold {3 * 4 * num_params / 2**20:.2f} MiB between steps)")
if args.explain and loss is not None:
    log(train_step.explain())
run.finish()
