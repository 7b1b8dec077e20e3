"""The command that starts torchrun on this machine as the tests start it, on a port of its
own: two test runs at once (two pytest processes, or ``pytest -n 2``) each start torchrun
jobs, and two jobs at torchrun's default port (29500) would meet in one group."""

from __future__ import annotations

import sys

from bench.helpers.runs import free_port


def torchrun_command(ranks: int, *args: str, launcher: tuple = ()) -> list[str]:
    """``python -m torch.distributed.run`` of ``ranks`` ranks running ``args`` (a script and
    its options, or ``-m module ...``). ``launcher``: torchrun's rendezvous options where the
    job sets its own (two agents meeting at an endpoint); otherwise a free port on loopback."""
    if not launcher:
        launcher = ("--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node",
            str(ranks), *args]
