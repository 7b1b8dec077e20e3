"""A progress bar for the examples' training loops, with no dependency.

On a terminal it redraws one line; in a log (not a TTY: torchrun piping, CI) it
prints a line per update, so the log keeps every step's loss.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, width: int = 24):
        self.total, self.done, self.enabled, self.width = total, start, enabled, width
        self.first = start
        self.began = time.perf_counter()
        self.redraw = enabled and sys.stdout.isatty()

    def update(self, text: str) -> None:
        """One more step done; ``text`` says how it went (loss, time)."""
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.began
        remaining = elapsed / (self.done - self.first) * (self.total - self.done)
        line = (f"[{bar}] step {self.done:{len(str(self.total))}d}/{self.total}  {text}  "
                f"eta {remaining:5.1f} s")
        if self.redraw:
            end = "\n" if self.done == self.total else ""
            print(f"\r{line}", end=end, flush=True)
        else:
            print(line, flush=True)
