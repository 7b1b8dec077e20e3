"""The examples run as a user runs them: torchrun on 2 CPU ranks, a few steps."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_gpt_with_bf16_accumulation_and_clipping():
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               os.path.join(ROOT, "examples", "train_gpt.py"), "--backend", "aot_eager",
               "--steps", "8", "--precision", "bf16", "--accumulation-steps", "2",
               "--max-grad-norm", "1.0"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)  ", run.stdout)]
    norms = [float(m) for m in re.findall(r"grad norm (\d+\.\d+)", run.stdout)]
    assert len(losses) == len(norms) == 8
    assert losses[-1] < losses[0]  # it learns
    assert "traffic per step" in run.stdout
