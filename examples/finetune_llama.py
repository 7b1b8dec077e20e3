"""Fine-tune a HuggingFace Llama with ZeRO on a tiny synthetic instruction dataset, and save it.

    pip install -e ".[examples]"
    torchrun --nproc_per_node 2 examples/finetune_llama.py             # 2 CPU ranks, stage 3
    torchrun --nproc_per_node 2 examples/finetune_llama.py --model-dir path/to/llama \\
        --save-dir tuned --steps 200 --lr 2e-5

The model is built on the meta device, which allocates nothing: each rank then creates only
what it keeps (in stage 3, its shards). With --model-dir (a folder ``save_pretrained``
wrote, safetensors), ``zero_fx.load_pretrained`` reads each rank's part of the weights
straight into its shards; without it, the model is a small Llama of random weights, which
the first call of the step initializes (the same values as building it normally).

With --save-dir, the trained model is saved at the end as HuggingFace saves one
(``save_pretrained``: config and safetensors), from ``step.full_state_dict()``: the
parameters are gathered one bucket at a time into rank 0's CPU memory, and rank 0 writes
the folder. ``AutoModelForCausalLM.from_pretrained(save_dir)`` loads it back; the script
checks that the reloaded model's logits equal the trained model's.

Each example is a prompt ("count by 3 from: 5 8 11 =") and an answer ("14 17 20"),
right-padded to one length: the labels are -100 on the prompt and the padding, so only the
answer is learned, and the attention mask hides the padding. Both keep every shape fixed,
which one graph needs.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples import hf_models  # noqa: E402

# -- data: "count by s from: a a+s a+2s =" -> "a+3s a+4s a+5s" (numbers modulo 50) --------
VOCAB, NUMBERS, PAD, COUNT, EQ = 64, 50, 60, 61, 62
"""The tokens the data uses (a model's vocabulary must hold at least VOCAB)."""
PROMPT, ANSWER = 3, 3
LENGTH = 2 + PROMPT + 1 + ANSWER + 2  # two tokens of padding at the end
HELD_OUT = 10_000
"""The batch number of the held-out batch: one the training loop never reaches."""


def example(g: torch.Generator):
    by = torch.randint(1, 5, (1,), generator=g)
    start = torch.randint(0, NUMBERS, (1,), generator=g)
    counted = (start + by * torch.arange(PROMPT + ANSWER)) % NUMBERS
    prompt = torch.cat([torch.tensor([COUNT]), by, counted[:PROMPT], torch.tensor([EQ])])
    answer = counted[PROMPT:]
    tokens = torch.cat([prompt, answer, torch.full((LENGTH - len(prompt) - ANSWER,), PAD)])
    labels = torch.full_like(tokens, -100)
    labels[len(prompt):len(prompt) + ANSWER] = answer  # learn the answer only
    mask = (tokens != PAD).long()
    return tokens, mask, labels


def global_batch(step: int, batch_size: int) -> list[torch.Tensor]:
    """Step ``step``'s whole batch, (tokens, mask, labels), the same on every rank and run."""
    g = torch.Generator().manual_seed(step)
    return [torch.stack(column) for column in zip(*(example(g) for _ in range(batch_size)))]


def main() -> None:
    from examples.launch import add_device_argument, launch
    from examples.progress import Progress
    from examples.summary import StepClock, summary
    from zero_fx import MixedPrecision, load_pretrained, zero_compile

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split over ranks")
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model-dir", default=None,
                        help="a local save_pretrained folder (safetensors) to start from "
                             "(default: a small Llama of random weights)")
    parser.add_argument("--save-dir", default=None,
                        help="save the trained model here at the end (save_pretrained)")
    add_device_argument(parser)
    args = parser.parse_args()
    hf_models.require_transformers()
    import transformers

    run = launch(device=args.device)
    if args.batch_size % run.world:
        parser.error(f"--batch-size {args.batch_size} must split evenly over {run.world} ranks")
    local = args.batch_size // run.world

    def get_batch(step: int):
        """This rank's slice of the global batch."""
        return [t[run.rank * local:(run.rank + 1) * local].to(run.device)
                for t in global_batch(step, args.batch_size)]

    # -- the model, on the meta device: shapes only, no memory ------------------------------
    if args.model_dir:
        config = transformers.AutoConfig.from_pretrained(args.model_dir)
    else:
        config = hf_models.llama_config(VOCAB, LENGTH, layers=4, width=128, heads=4, kv_heads=2,
                                        ffn=256)
    if config.vocab_size < VOCAB:
        parser.error(f"the model's vocabulary ({config.vocab_size}) is smaller than the "
                     f"{VOCAB} tokens the data uses")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = hf_models.causal_lm(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    run.log(f"Llama with {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
            f"stage {args.stage}, {run.world} rank(s), backend {args.backend}")

    @zero_compile(stage=args.stage, backend=args.backend,
                  mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                 output_dtype=torch.float32)
                  if args.precision == "bf16" else None)
    def train_step(model, opt, tokens, mask, labels):
        loss = model(input_ids=tokens, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if args.model_dir:  # every rank reads its part of the files into its shards, now
        loaded = load_pretrained(train_step, args.model_dir, model, opt)
        run.log(f"loaded {loaded.tensors} tensors from {args.model_dir}; rank 0 read "
                f"{loaded.bytes_read:,} of their {loaded.file_bytes:,} bytes")
    # else: the first call initializes the meta model (its own init, replayed per module)

    @torch.no_grad()
    def logits(tokens, mask):
        """The model's logits, run outside the step (in stage 3 the parameters are gathered
        for the block: a collective, on every rank)."""
        with train_step.gathered_parameters():
            return model(input_ids=tokens, attention_mask=mask).logits.float()

    def answer_accuracy(tokens, mask, labels) -> float:
        """Greedy next-token accuracy on the answer tokens."""
        predicted, target = logits(tokens, mask)[:, :-1].argmax(-1), labels[:, 1:]
        scored = target != -100
        right = run.mean_over_ranks((predicted[scored] == target[scored]).float().mean())
        return right.item()

    clock, loss = StepClock(run.device), None  # waits for a GPU before reading the time
    progress = Progress(args.steps, enabled=run.rank == 0)
    for step in progress:  # the first step compiles; then a progress bar (a line per step in a log)
        clock.start()
        loss = run.mean_over_ranks(train_step(model, opt, *get_batch(step)))
        seconds = clock.stop()
        progress.update(f"loss {loss.item():.4f}  {1e3 * seconds:8.1f} ms")

    held_out = get_batch(HELD_OUT)
    accuracy = answer_accuracy(*held_out)
    run.log("\n" + summary(train_step, final_loss=loss.item(), clock=clock))
    run.log(f"answer accuracy on held-out examples: {accuracy:.1%}")

    if args.save_dir:
        # the whole state dict (fp32 masters), gathered a bucket at a time into rank 0's CPU
        # memory; the other ranks get {} (a collective: every rank calls it)
        state = train_step.full_state_dict(cpu_offload=True)
        trained = logits(*held_out[:2]).cpu()
        if run.rank == 0:
            # the meta model gives save_pretrained the config and the names; state the values
            model.save_pretrained(args.save_dir, state_dict=state)
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(args.save_dir)
            with torch.no_grad():
                tokens, mask = held_out[0].cpu(), held_out[1].cpu()
                again = reloaded(input_ids=tokens, attention_mask=mask).logits
            difference = (again.float() - trained).abs().max().item()
            run.log(f"saved {args.save_dir} (save_pretrained, {len(state)} tensors); reloaded with "
                    f"from_pretrained, its logits on held-out examples differ from the trained "
                    f"model's by at most {difference:.3g}"
                    + (" (it computed in bf16, the file holds the fp32 masters)"
                       if args.precision == "bf16" else ""))
    run.finish()


if __name__ == "__main__":
    main()
