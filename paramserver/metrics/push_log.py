"""Metrics of a shard's push log: records appended and their bytes, its size on disk, writes, replays.

Owns ``PushLogCollector``, which reads, at scrape time, the figures the
shard's push log keeps anyway (``paramserver.shards.server.push_log.LogFigures``,
as a mapping, through the callable the runtime gives it; ``None`` when the
shard keeps no log), so a push records nothing for metrics.  Appends per
second are the rate of ``paramserver_push_log_appends_total``.  It imports
nothing of the data plane.
"""

from typing import Callable, Iterator, Mapping, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: The figures' names (``LogFigures.as_dict()``) -> (metric, kind, help).
_METRICS = {
    "appends": ("paramserver_push_log_appends", "counter",
                "Records appended to this shard's push log (pushes applied, dynamic tables' training lookups, marks)"),
    "appended_bytes": ("paramserver_push_log_appended_bytes", "counter", "Bytes appended to this shard's push log"),
    "flushes": ("paramserver_push_log_writes", "counter",
                "Writes of the push log's pending records (one per request that applied something, or fewer)"),
    "flush_seconds": ("paramserver_push_log_write_seconds", "counter",
                      "Seconds spent checksumming and writing the push log"),
    "replayed": ("paramserver_push_log_replayed_records", "counter",
                 "Records this shard process applied again from its push log when it came back"),
    "size_bytes": ("paramserver_push_log_bytes", "gauge",
                   "Bytes of this shard's push log on disk (at most about one checkpoint interval)"),
}


class PushLogCollector(Collector):
    """The push log whose figures ``figures()`` gives (nothing while there is none)."""

    def __init__(self, figures: Callable[[], Optional[Mapping[str, float]]]):
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        figures = self._figures()
        if figures is None:
            return
        for key, (name, kind, text) in _METRICS.items():
            family = CounterMetricFamily(name, text) if kind == "counter" else GaugeMetricFamily(name, text)
            family.add_metric([], figures.get(key, 0.0))
            yield family
