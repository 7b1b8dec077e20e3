"""Progress of a training loop: the first step, which compiles, as a phase of its own, then
a tqdm bar over the other steps, whose rate and time left leave the compile out.

On a terminal::

    step 1/30: compiling the step ... done in 41.2 s  loss 4.1733  41230.1 ms
    steps: 100%|██████████| 30/30 [00:03<00:00,  9.12 step/s, loss 2.3120  108.1 ms]

In a log (stdout not a terminal: torchrun piping, CI) a plain line per step (or per
``every`` steps), which scripts and tests read::

    step 1/30: compiling the step ...
    step  1/30  loss 4.1733  41230.1 ms
    step  2/30  loss 4.0211    108.4 ms
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Iterator

from tqdm import tqdm


class Progress:
    """Steps ``start`` to ``total`` (counted from 1 in what it prints).

    ``for step in progress:`` yields the 0-based step numbers (or call ``begin()`` before
    the first step yourself); after each step, ``update(text)`` says how it went.
    ``enabled=False`` prints nothing (every rank but 0). ``first``: what the first step
    does beyond a step's work. ``label`` starts every line. ``every``: in a log, a line
    every so many steps (and for the first and last).
    """

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True,
                 first: str = "compiling the step", label: str = "", every: int = 1):
        self.total, self.start, self.done = total, start, start
        self.enabled, self.first, self.label, self.every = enabled, first, label, every
        # tqdm shows nothing on a terminal of no size (some ptys): log lines there
        self.terminal = enabled and sys.stdout.isatty() and min(shutil.get_terminal_size((0, 0))) > 0
        self.began: float | None = None
        self.bar: tqdm | None = None

    def __iter__(self) -> Iterator[int]:
        try:
            for step in range(self.start, self.total):
                if step == self.start:
                    self.begin()
                yield step
        finally:
            self.close()

    def begin(self) -> None:
        """The first step starts now."""
        self.began = time.perf_counter()
        if self.enabled and self.done < self.total:
            print(f"{self.label}step {self.done + 1}/{self.total}: {self.first} ...",
                  end="" if self.terminal else "\n", flush=True)

    def update(self, text: str) -> None:
        """One more step done; ``text`` says how it went (loss, time)."""
        self.done += 1
        if not self.enabled:
            return
        first = self.done == self.start + 1
        if not self.terminal:
            if first or self.done == self.total or self.done % self.every == 0:
                width = len(str(self.total))
                print(f"{self.label}step {self.done:{width}d}/{self.total}  {text}", flush=True)
            return
        if first:
            seconds = time.perf_counter() - (self.began or time.perf_counter())
            print(f" done in {seconds:.1f} s  {text}", flush=True)
            if self.done < self.total:
                self.bar = tqdm(total=self.total, initial=self.done, file=sys.stdout,
                                desc=f"{self.label}steps", unit="step", dynamic_ncols=True)
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        """A line of its own, under the bar rather than through it."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
