"""``ReadLatency``: how long a tier's reads took, counted in fixed buckets, as a Prometheus histogram counts them.

Owns the buckets (``READ_SECONDS_BUCKETS``) and the counts of the reads that
fell in each, their sum and their number, since the tier was made; a
scrape reads them (``snapshot``) and exports them as a histogram, so its
quantiles over any window are Prometheus's (``histogram_quantile``).  A
read adds one count, under a lock of its own (a scrape reads from another
thread); it imports nothing of the metrics.
"""

import bisect
import threading
from dataclasses import dataclass
from typing import List, Tuple

#: The buckets' upper bounds, seconds: 20 µs (a few ids in the engine's memtables or block cache) to 1 s (many
#: thousands of ids from a slow disk).
READ_SECONDS_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                        0.25, 0.5, 1.0)


@dataclass(frozen=True)
class LatencySnapshot:
    """The reads counted so far: ``buckets``, ``(upper bound, reads at most that long)`` pairs, cumulative, the
    last ``+Inf`` (every read); ``sum_seconds``, their total time."""

    buckets: Tuple[Tuple[float, int], ...]
    sum_seconds: float

    @property
    def count(self) -> int:
        return self.buckets[-1][1]


class ReadLatency:
    """The reads' times in ``READ_SECONDS_BUCKETS`` (and one bucket past the last bound)."""

    def __init__(self):
        self._counts: List[int] = [0] * (len(READ_SECONDS_BUCKETS) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()  # a scrape reads them from another thread than the reads

    def observe(self, seconds: float) -> None:
        at = bisect.bisect_left(READ_SECONDS_BUCKETS, seconds)  # a bound is the bucket's inclusive upper end
        with self._lock:
            self._counts[at] += 1
            self._sum += seconds

    def snapshot(self) -> LatencySnapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(READ_SECONDS_BUCKETS + (float("inf"),), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        return LatencySnapshot(tuple(buckets), total)
