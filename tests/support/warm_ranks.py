"""Imported by the fork server every rank is forked from (``ranks.PRELOADED``): what each
rank process otherwise set up for itself, done once there and inherited by every fork.

- transformers and the model modules of the HF tests (GPT-2, Llama, Mixtral, Qwen3-MoE):
  importing them took each rank that built an HF model about 5 s of the 2-core box.
- one compilation of the test GPT's step at world sizes 2 and 4 on a fake group: the
  first-call set-up of Dynamo, make_fx, fake tensors and our passes, the kept traces of the
  passes' splices ([Note: one trace per distinct splice] in passes/common/splice.py), and the kept
  capture of that step ([Note: kept captures] in zero_fx/capture/kept_captures.py), which
  a rank's first compilation of the GPT then copies instead of tracing.

Measured on the 2-core box, the first compilation in a process forked after this against
one forked without (CPU seconds): the GPT at stage 3 on 2 ranks 2.3-3.1 -> 0.9-1.0, at
stage 1 on 4 ranks 2.4 -> 2.0, the MLP (aot_eager) 1.6 -> 1.1, HF Llama 5.2-6.0 -> 4.3-4.8.
The suite starts about 85 rank processes. What a run may change is put back as before
(``ranks._ProcessState``), and nothing of this reaches a run's numbers: a kept capture is
copied only for a step that traces to the same graph.

A failure here leaves the ranks cold and says so: it is never raised, since the fork
server would die of it and no rank could start."""

from __future__ import annotations

import random
import sys
import traceback

import torch

WORLD_SIZES = (2, 4)


def _import_transformers() -> None:
    try:
        from examples import hf_models  # noqa: F401 (imports transformers)
        from transformers.models.gpt2 import modeling_gpt2  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401
        from transformers.models.mixtral import modeling_mixtral  # noqa: F401
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
    except ImportError:  # the HF tests skip without transformers
        pass


def _compile_the_gpt_step() -> None:
    from support import models
    from support.ranks import fake_world
    from zero_fx import zero_compile

    for world_size in WORLD_SIZES:
        with fake_world(world_size):
            model = models.build("gpt")
            step = zero_compile(models.training_step("gpt"), stage=3, backend=models.BACKEND)
            x, y = models.global_batch("gpt", 0)
            step(model, models.make_optimizer(model, "adamw"), x.chunk(world_size)[0],
                 y.chunk(world_size)[0])


def warm() -> None:
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    try:
        _import_transformers()
        _compile_the_gpt_step()
    except Exception:
        print("tests/support/warm_ranks.py: the fork server's warm-up failed, so every rank starts "
              "cold (slower, not wrong):\n" + traceback.format_exc(), file=sys.stderr)
    finally:
        torch._dynamo.reset()
        torch.set_rng_state(torch_rng)
        random.setstate(python_rng)


warm()
