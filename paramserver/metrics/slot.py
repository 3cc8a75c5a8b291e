"""The process-wide switch between "metrics off" and one set of metrics.

Owns ``Slot``: where instrumented code finds the metrics this process
serves (``None`` unless the process was started with ``--metrics-port``),
so that a hot path pays one attribute read when metrics are off.  Torch
RPC and DDP are per process, so their metrics are too.  It owns no metric
and knows nothing of HTTP.
"""

from contextlib import contextmanager
from typing import Generic, Iterator, Optional, TypeVar

Metrics = TypeVar("Metrics")


class Slot(Generic[Metrics]):
    """Holds this process's active instance (or ``None``)."""

    def __init__(self):
        self.active: Optional[Metrics] = None

    def install(self, metrics: Optional[Metrics]) -> Optional[Metrics]:
        """Make ``metrics`` the active instance; returns the one it replaces (give it to ``install`` to go back)."""
        previous, self.active = self.active, metrics
        return previous

    @contextmanager
    def installed(self, metrics: Metrics) -> Iterator[Metrics]:
        """``metrics`` is the active instance inside the block; the previous one comes back after it."""
        previous = self.install(metrics)
        try:
            yield metrics
        finally:
            self.install(previous)
