"""Showing a long run's progress: a bar on a terminal, plain lines otherwise.

Owns rendering ``(done, total, figures)`` for a person watching: on a
terminal one line redrawn in place (at most a few times a second); in a
log or a pipe one plain line every ``every`` seconds and at the end.
"""

import shutil
import sys
import time
from typing import Mapping, Optional, TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None, every: float = 10.0):
        self.total = max(1, total)
        self.label = label
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self._every = 0.2 if self.interactive else every
        self._last = -float("inf")
        self._started = time.monotonic()

    def update(self, done: int, figures: Mapping[str, str], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._every:
            return
        self._last = now
        details = "  ".join(f"{key} {value}" for key, value in figures.items())
        elapsed = f"{now - self._started:.0f}s"
        if self.interactive:
            width = max(10, min(40, shutil.get_terminal_size((100, 20)).columns - 60 - len(details)))
            filled = int(width * min(done, self.total) / self.total)
            line = f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {elapsed}  {details}"
            self.stream.write(line[:shutil.get_terminal_size((200, 20)).columns] + "\033[K")
        else:
            self.stream.write(f"{self.label}: step {done}/{self.total} after {elapsed}  {details}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
