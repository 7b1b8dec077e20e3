"""The training steps people write, as they write them: each idiom is a plain step function
that ``test_step_idioms.py`` decorates with ``@zero_compile`` on N ranks and runs undecorated
in one process on the global batch.

An idiom is ``make(model, opt) -> (step, call)``: ``step`` is the user's function, and
``call(step, model, opt, x, y)`` calls it once for a batch (its return value is what the test
reads: a loss as a tensor or a number, or a dict with a "loss")."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger("step_idioms")


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _plain_call(step, model, opt, x, y):
    return step(model, opt, x, y)


def zero_grad_first(model, opt):
    def step(model, opt, x, y):
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        return loss
    return step, _plain_call


def metrics_dict(model, opt):
    def step(model, opt, x, y):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        accuracy = (logits.argmax(-1) == y).float().mean()
        return {"loss": loss, "accuracy": accuracy}
    return step, _plain_call


def autocast(model, opt):
    def step(model, opt, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step, _plain_call


def print_item(model, opt):
    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        loss.backward()
        print("loss", loss.item())
        opt.step()
        opt.zero_grad()
        return loss
    return step, _plain_call


def logger_info(model, opt):
    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        logger.info("loss %.6f", loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step, _plain_call


def return_item(model, opt):
    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step, _plain_call


BRANCH_THRESHOLD = 100
"""As people write it: a guard that rarely fires. Each rank branches on its own loss, so a
threshold the losses straddle would make ranks differ from each other and from eager on the
global batch (as under DDP); tests/test_graph_breaks.py takes the branch both ways."""


def branch_on_loss(model, opt):
    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        if loss > BRANCH_THRESHOLD:
            loss = loss * 0.5
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step, _plain_call


def clip_grad_norm(model, opt):
    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return {"loss": loss, "grad_norm": norm}
    return step, _plain_call


def scheduler(model, opt):
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))

    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        lr_schedule.step()
        opt.zero_grad()
        return loss

    def call(step, model, opt, x, y):
        loss = step(model, opt, x, y)
        return {"loss": loss, "lr": opt.param_groups[0]["lr"]}
    return step, call


def grad_scaler(model, opt):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)

    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss

    def call(step, model, opt, x, y):
        loss = step(model, opt, x, y)
        return {"loss": loss, "scale": scaler.get_scale()}
    return step, call


def two_backward_calls(model, opt):
    def step(model, opt, x, y):
        half, total = x.shape[0] // 2, 0.0
        for xs, ys in ((x[:half], y[:half]), (x[half:], y[half:])):
            loss = _loss(model, xs, ys) / 2
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        return total
    return step, _plain_call


LENGTHS = (16, 12, 8, 12)
"""Sequence lengths of the calls: three distinct ones."""


def varying_lengths(model, opt):
    lengths = iter(LENGTHS * 4)

    def step(model, opt, x, y):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def call(step, model, opt, x, y):
        length = next(lengths)
        return step(model, opt, x[:, :length].contiguous(), y[:, :length].contiguous())
    return step, call


IDIOMS = {f.__name__: f for f in (
    zero_grad_first, metrics_dict, autocast, print_item, logger_info, return_item,
    branch_on_loss, clip_grad_norm, scheduler, grad_scaler, two_backward_calls,
    varying_lengths)}
"""The twelve idioms of issue 65, by name."""

PRINTS = {"print_item": "loss", "logger_info": "loss"}
"""Idioms that print or log a line per call, and how the line starts."""
