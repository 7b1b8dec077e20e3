"""Train a small HuggingFace Mixtral (a mixture of experts) with ZeRO, bytewise on a text file.

    pip install -e ".[examples]"
    torchrun --nproc_per_node 2 examples/train_mixtral.py            # 2 CPU ranks, stage 3
    torchrun --nproc_per_node 2 examples/train_mixtral.py --expert-parallel 2   # experts split
    torchrun --nproc_per_node 2 examples/train_mixtral.py --layers 4 --width 128 \\
        --experts 8 --top-k 2 --seq 64 --steps 300

The model is ``MixtralForCausalLM`` built from a config (random weights, no hub access):
every decoder layer's feed-forward is --experts experts, of which a router picks --top-k
per token. The text (--data; by default examples/data/shakespeare.txt, as
examples/train_gpt.py reads it) is read byte by byte: a vocabulary of 256, no tokenizer.

HuggingFace's Mixtral runs only the experts that received tokens, a loop whose count
depends on the routing; zero_fx rewrites each such block, before the first capture, to a
fixed-shape forward of the same mathematics (docs/moe.md). The script calls the model as
HuggingFace documents it: with ``output_router_logits=True`` in the config,
``outputs.loss`` is the language-model loss plus ``router_aux_loss_coef`` times the router's
load-balancing loss (``outputs.aux_loss``), so the router learns to spread the tokens. Each
step prints both; at the end, what zero_fx did with the experts (``step.moe_blocks``).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples import hf_models  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare.txt")


def main() -> None:
    from examples.launch import add_device_argument, launch
    from examples.progress import Progress
    from examples.summary import StepClock, summary
    from zero_fx import MixedPrecision, zero_compile

    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=DATA,
                        help="a text file, read byte by byte (vocabulary 256)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (one MoE block each)")
    parser.add_argument("--width", type=int, default=64, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (divide --width)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (divide --heads)")
    parser.add_argument("--ffn", type=int, default=128, help="each expert's hidden size")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE block")
    parser.add_argument("--top-k", type=int, default=2, help="experts each token is routed to")
    parser.add_argument("--aux-loss-coef", type=float, default=0.02,
                        help="weight of the router's load-balancing loss in the objective")
    parser.add_argument("--seq", type=int, default=32, help="tokens (bytes) per sequence")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps to train for")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over ranks")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (AdamW)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3],
                        help="0 = DDP, 1 = shard optimizer states, 2 = + gradients, "
                             "3 = + parameters")
    parser.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: compute and all-gather in bf16 (experts by torch._grouped_mm), "
                             "fp32 masters")
    parser.add_argument("--expert-parallel", type=int, default=1,
                        help="stage 3: split each block's experts over this many ranks (divides "
                             "--experts and the number of ranks); 1: every rank runs every expert")
    parser.add_argument("--explain", action="store_true",
                        help="print what zero_fx did: plan, collectives, memory")
    add_device_argument(parser)
    args = parser.parse_args()
    hf_models.require_transformers()
    if args.width % args.heads or args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must divide --width {args.width}, and --kv-heads "
                     f"{args.kv_heads} must divide --heads")
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")

    run = launch(device=args.device)
    if args.batch_size % run.world:
        parser.error(f"--batch-size {args.batch_size} must split evenly over {run.world} ranks")
    local = args.batch_size // run.world

    # -- data: the file's bytes are the tokens; random windows, the same on every run ------
    with open(args.data, "rb") as f:
        text = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    if len(text) <= args.seq:
        parser.error(f"{args.data}: {len(text):,} bytes, fewer than --seq {args.seq}")

    def get_batch(step: int) -> torch.Tensor:
        """This rank's slice of step ``step``'s global batch of windows. HuggingFace shifts
        the labels itself: each window is both the input and the labels."""
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        starts = torch.randint(0, len(text) - args.seq, (args.batch_size,), generator=g)
        starts = starts[run.rank * local:(run.rank + 1) * local].tolist()
        return torch.stack([text[s:s + args.seq] for s in starts]).long().to(run.device)

    # -- the model: plain HuggingFace, from a config ------------------------------------------
    config = hf_models.mixtral_config(256, args.seq, layers=args.layers, width=args.width,
                                      heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn,
                                      experts=args.experts, top_k=args.top_k,
                                      aux_loss_coef=args.aux_loss_coef)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = hf_models.causal_lm(config).to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    num_params = sum(p.numel() for p in model.parameters())
    run.log(f"Mixtral with {num_params / 1e6:.2f}M parameters ({args.layers} layers, width "
            f"{args.width}, {args.experts} experts of width {args.ffn}, top-{args.top_k}), "
            f"stage {args.stage}, {run.world} rank(s), backend {args.backend}, "
            f"{args.precision}; {len(text):,} bytes of {os.path.basename(args.data)}")

    # -- the training step: the one line where zero_fx plugs in ---------------------------------
    @zero_compile(stage=args.stage, backend=args.backend, expert_parallel=args.expert_parallel,
                  mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                 output_dtype=torch.float32)
                  if args.precision == "bf16" else None)
    def train_step(model, opt, tokens):
        out = model(input_ids=tokens, labels=tokens)  # loss = LM loss + coef * aux_loss
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return out.loss, out.aux_loss

    # -- training loop: the first step compiles, then a line per step in a log -------------------
    clock, loss = StepClock(run.device), None
    began = time.perf_counter()
    progress = Progress(args.steps, enabled=run.rank == 0)
    for step in progress:
        clock.start()
        loss, aux = train_step(model, opt, get_batch(step))
        loss, aux = run.mean_over_ranks(loss), run.mean_over_ranks(aux)
        seconds = clock.stop()
        progress.update(f"loss {loss.item():.4f}  aux {aux.item():.4f}  "
                        f"{1e3 * seconds:8.1f} ms")

    # -- summary -------------------------------------------------------------------------------
    if loss is not None:
        run.log("\n" + summary(train_step, final_loss=loss.item(), clock=clock))
        run.log(f"wall time {time.perf_counter() - began:.1f} s for {args.steps} steps")
    blocks = train_step.moe_blocks
    if blocks:
        first = blocks[0]
        run.log(f"mixture of experts: zero_fx routed {len(blocks)} block(s) with fixed shapes, "
                f"{first.num_experts} experts each, top-{first.top_k} ({first.routing}); "
                f"{sum(b.expert_parameters for b in blocks):,} expert parameters of "
                f"{num_params:,}")
        for b in blocks:
            run.log(f"  {b.name}: {b.num_experts} experts, top-{b.top_k}, {b.routing}"
                    + (f", shared expert {b.shared_expert}" if b.shared_expert else ""))
        if args.expert_parallel > 1:
            run.log(f"expert parallelism {args.expert_parallel}: each rank runs "
                    f"{first.num_experts // args.expert_parallel} of each block's experts and "
                    f"exchanges tokens by all_to_all (in the traffic line above)")
    if args.explain:
        run.log(train_step.explain())
    run.finish()


if __name__ == "__main__":
    main()
