import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
import zero_fx
from zero_fx import zero_compile

run = zero_fx.init_distributed()
logging.basicConfig(format="%(message)s", level=logging.INFO if run.is_main else logging.WARNING)
logger = logging.getLogger("train")     # logs on rank 0 only; every rank runs the same step
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(256, 128), nn.Linear(128, 512), nn.GELU(),
                      nn.Linear(512, 256)).to(run.device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
warmup, total = 5, 20                   # linear warm-up, then linear decay to zero
scheduler = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: min((s + 1) / warmup, (total - s) / (total - warmup)))

@zero_compile(stage=3, backend="aot_eager")
def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    scheduler.step()
    opt.zero_grad()
    logger.info("loss %.3f, grad norm %.3f", loss.item(), grad_norm)
    return {"loss": loss, "grad_norm": grad_norm}

data = torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(1))
for step in range(total):
    rows = torch.arange(8 * step, 8 * step + 8) % 64
    batch = data[rows[run.rank::run.world_size]].to(run.device)
    metrics = train_step(model, opt, batch[:, :-1], batch[:, 1:])
if run.is_main:
    print(f"done: loss {metrics['loss'].item():.3f}, lr {scheduler.get_last_lr()[0]:.2e}")

if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
