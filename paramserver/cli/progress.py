"""Showing a long run's progress through tqdm: a bar on a terminal, plain lines in a log.

Owns choosing how ``(done, total, figures)`` reaches a person: on a
terminal tqdm's bar, moved whenever ``update`` is called (a command calls it
as steps are reported, about every second); in a log or a pipe tqdm's meter
as one plain line at most every ``every`` seconds, and at the end.  Draws
nothing itself; does not own where the steps come from.
"""

import sys
import time
from typing import Mapping, Optional, TextIO

from tqdm import tqdm

#: A log gets one line at most this often (seconds).
LOG_EVERY = 10.0


class Progress:
    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, every: float = LOG_EVERY):
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.total, self.label, self.every = max(1, total), label, every
        self._bar = tqdm(total=self.total, desc=label, unit="step", file=self.stream, dynamic_ncols=True,
                         disable=not self.interactive)
        self._started, self._last_line = time.monotonic(), -float("inf")

    def update(self, done: int, figures: Mapping[str, str], force: bool = False) -> None:
        postfix = "  ".join(f"{key} {value}" for key, value in figures.items())
        if self.interactive:
            self._bar.n = min(done, self.total)
            self._bar.set_postfix_str(postfix, refresh=True)
            return
        now = time.monotonic()
        if force or now - self._last_line >= self.every:
            self._last_line = now
            line = tqdm.format_meter(min(done, self.total), self.total, now - self._started,
                                     prefix=self.label, unit="step", postfix=postfix or None, ascii=True)
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        self._bar.close()
