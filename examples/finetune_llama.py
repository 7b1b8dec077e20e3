"""Fine-tune a HuggingFace Llama with ZeRO on a tiny synthetic instruction dataset.

    pip install -e ".[hf]"
    torchrun --nproc_per_node 2 examples/finetune_llama.py             # 2 CPU ranks, stage 3
    torchrun --nproc_per_node 2 examples/finetune_llama.py --model-dir path/to/llama

The model is a ``transformers`` LlamaForCausalLM built from a config with random weights
(no hub access), or the weights saved in --model-dir (``save_pretrained``). Each example is
a prompt ("count by 3 from: 5 8 11 =") and an answer ("14 17 20"), right-padded to one length: the
labels are -100 on the prompt and the padding, so only the answer is learned, and the
attention mask hides the padding. Both keep every shape fixed, which one graph needs.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples import hf_models  # noqa: E402
from examples.launch import add_device_argument, launch  # noqa: E402
from examples.progress import Progress  # noqa: E402
from examples.summary import StepClock, summary  # noqa: E402
from zero_fx import MixedPrecision, zero_compile  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--batch-size", type=int, default=16, help="global batch, split over ranks")
parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
parser.add_argument("--backend", default="inductor", help="inductor | aot_eager | eager")
parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--model-dir", default=None,
                    help="a local save_pretrained folder to start from (default: random weights)")
add_device_argument(parser)
args = parser.parse_args()
hf_models.require_transformers()
run = launch(device=args.device)

# -- data: "count by s from: a a+s a+2s =" -> "a+3s a+4s a+5s" (numbers modulo 50) --------
VOCAB, NUMBERS, PAD, COUNT, EQ = 64, 50, 60, 61, 62
PROMPT, ANSWER = 3, 3
LENGTH = 2 + PROMPT + 1 + ANSWER + 2  # two tokens of padding at the end


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


def get_batch(step: int):
    g = torch.Generator().manual_seed(step)
    rows = [example(g) for _ in range(args.batch_size)]
    local = args.batch_size // run.world
    rows = rows[run.rank * local:(run.rank + 1) * local]
    return [torch.stack(column).to(run.device) for column in zip(*rows)]


assert args.batch_size % run.world == 0, "the global batch must split evenly over ranks"

# -- model and optimizer: plain HuggingFace and PyTorch ------------------------------------
torch.manual_seed(0)
if args.model_dir:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir)
    model.loss_type = "ForCausalLM"  # otherwise it logs from inside the step (a graph break)
else:
    model = hf_models.causal_lm(hf_models.llama_config(
        VOCAB, LENGTH, layers=4, width=128, heads=4, kv_heads=2, ffn=256))
model = model.to(run.device)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
run.log(f"Llama with {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"stage {args.stage}, {run.world} rank(s), backend {args.backend}")


@zero_compile(stage=args.stage, backend=args.backend,
              mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
              if args.precision == "bf16" else None)
def train_step(model, opt, tokens, mask, labels):
    loss = model(input_ids=tokens, attention_mask=mask, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def answer_accuracy(tokens, mask, labels) -> float:
    """Greedy next-token accuracy on the answer tokens (the model run outside the step)."""
    with torch.no_grad(), train_step.gathered_parameters():
        logits = model(input_ids=tokens, attention_mask=mask).logits
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
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

accuracy = answer_accuracy(*get_batch(10_000))  # a batch the loop never saw
run.log("\n" + summary(train_step, final_loss=loss.item(), clock=clock))
run.log(f"answer accuracy on held-out examples: {accuracy:.1%}")
run.finish()
