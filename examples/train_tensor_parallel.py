"""Train a Llama-style decoder with ZeRO over tensor parallelism, bytewise on a text file.

    torchrun --nproc_per_node 4 examples/train_tensor_parallel.py --tp 2    # (shard 2, tp 2)
    torchrun --nproc_per_node 4 examples/train_tensor_parallel.py --tp 2 --sequence-parallel
    torchrun --nproc_per_node 4 examples/train_tensor_parallel.py --tp 4 --stage 1

The ranks form a ("shard", "tp") device mesh: --tp consecutive ranks split each block's
matrix products as Megatron-LM does (q, k, v and the MLP's gate and up projections by
columns, the attention's output and the MLP's down projection by rows), with PyTorch's own
``parallelize_module``; zero_fx shards each rank's piece over the "shard" dimension (ZeRO
stage --stage) and keeps DTensor's tensor-parallel collectives where they are
(docs/tensor-parallel.md). The ranks of one "tp" group read the same batch. With
--sequence-parallel the norms run on a rank's slice of the sequence, and the embedding and
the output head are split by rows of the vocabulary.

The model is zero_fx's Llama (zero_fx/models.py: RMSNorm, rotary positions,
grouped-query attention, SwiGLU) at a small size; the text (--data; by default
examples/data/shakespeare.txt) is read byte by byte: a vocabulary of 256, no tokenizer.
The summary at the end gives the traffic of a step: ZeRO's collectives, and the
tensor-parallel ones (``tp_all_reduce``...) on the tp group, apart.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "shakespeare.txt")


def parallelize(model, tp_mesh, sequence_parallel: bool):
    """Split ``model``'s blocks over ``tp_mesh`` (and, with ``sequence_parallel``, its norms
    over the sequence and its embedding and head over the vocabulary)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    if not sequence_parallel:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    else:
        seq = Shard(1)  # the activations between blocks: a slice of the sequence per rank
        plan = {"attn_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                # the attention gathers the whole sequence once, for q, k and v
                "attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                           desired_input_layouts=(Replicate(), None, None)),
                "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(output_layouts=seq),
                "w1": ColwiseParallel(input_layouts=seq), "w3": ColwiseParallel(input_layouts=seq),
                "w2": RowwiseParallel(output_layouts=seq)}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        seq = Shard(1)
        parallelize_module(model, tp_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())})
    return model


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from examples.launch import add_device_argument, launch
    from examples.progress import Progress
    from examples.summary import StepClock, summary
    from zero_fx import zero_compile
    from zero_fx.models import Llama, LlamaConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=DATA, help="a text file, read byte by byte (vocabulary 256)")
    parser.add_argument("--tp", type=int, default=2,
                        help="ranks each block's matrix products split over (divides the number "
                             "of ranks, --heads, --kv-heads and --ffn)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="norms on a slice of the sequence; embedding and head split by rows")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks")
    parser.add_argument("--width", type=int, default=64, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (divide --width)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (divide --heads)")
    parser.add_argument("--ffn", type=int, default=128, help="the MLP's hidden size")
    parser.add_argument("--seq", type=int, default=32, help="tokens (bytes) per sequence")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train for")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="global batch, split over the data-parallel ranks (ranks / --tp)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (AdamW)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3],
                        help="1 = shard optimizer states, 2 = + gradients, 3 = + parameters")
    parser.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager")
    parser.add_argument("--explain", action="store_true",
                        help="print what zero_fx did: plan, collectives, memory")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.width % args.heads or args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must divide --width {args.width}, and --kv-heads "
                     f"{args.kv_heads} must divide --heads")
    if args.kv_heads % args.tp or args.ffn % args.tp:
        parser.error(f"--tp {args.tp} must divide --kv-heads {args.kv_heads} and --ffn {args.ffn}: "
                     "each rank takes whole heads and an equal slice of the MLP")
    if args.sequence_parallel and (args.seq % args.tp or 256 % args.tp):
        parser.error(f"--sequence-parallel splits --seq {args.seq} and the vocabulary (256) over "
                     f"--tp {args.tp}: it must divide both")

    run = launch(device=args.device)
    if run.world % args.tp:
        parser.error(f"--tp {args.tp} must divide the number of ranks, {run.world}")
    shards = run.world // args.tp
    if args.batch_size % shards:
        parser.error(f"--batch-size {args.batch_size} must split evenly over {shards} "
                     f"data-parallel rank(s)")
    mesh = init_device_mesh(run.device.type, (shards, args.tp), mesh_dim_names=("shard", "tp"))
    data_rank, local = mesh.get_local_rank("shard"), args.batch_size // shards

    # -- data: the file's bytes are the tokens; one "tp" group reads one slice of a batch ----
    with open(args.data, "rb") as f:
        text = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    if len(text) <= args.seq + 1:
        parser.error(f"{args.data}: {len(text):,} bytes, too few for --seq {args.seq}")

    def get_batch(step: int):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        starts = torch.randint(0, len(text) - args.seq - 1, (args.batch_size,), generator=g)
        starts = starts[data_rank * local:(data_rank + 1) * local].tolist()
        windows = torch.stack([text[s:s + args.seq + 1] for s in starts]).long().to(run.device)
        return windows[:, :-1], windows[:, 1:]

    # -- the model: plain PyTorch, split over "tp" by PyTorch's own API ------------------------
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = LlamaConfig(vocab_size=256, dim=args.width, n_layer=args.layers, n_head=args.heads,
                      n_kv_head=args.kv_heads, ffn_dim=args.ffn, max_positions=args.seq)
    model = Llama(cfg).to(run.device)
    num_params = sum(p.numel() for p in model.parameters())
    parallelize(model, mesh["tp"], args.sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    run.log(f"Llama with {num_params / 1e6:.2f}M parameters ({args.layers} layers, width "
            f"{args.width}), stage {args.stage} over {shards} data-parallel rank(s) x tp "
            f"{args.tp}" + (" with sequence parallelism" if args.sequence_parallel else "")
            + f", backend {args.backend}; {len(text):,} bytes of {os.path.basename(args.data)}")

    # -- the training step: the mesh is the only change ---------------------------------------
    @zero_compile(stage=args.stage, backend=args.backend, mesh=mesh)
    def train_step(model, opt, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    clock, loss = StepClock(run.device), None
    progress = Progress(args.steps, enabled=run.rank == 0)
    for step in progress:
        clock.start()
        loss = run.mean_over_ranks(train_step(model, opt, *get_batch(step)))
        seconds = clock.stop()
        progress.update(f"loss {loss.item():.4f}  {1e3 * seconds:8.1f} ms")
    if loss is not None:
        run.log("\n" + summary(train_step, final_loss=loss.item(), clock=clock))
    if args.explain:
        run.log(train_step.explain())
    run.finish()


if __name__ == "__main__":
    main()
