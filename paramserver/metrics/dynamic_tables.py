"""Metrics of a shard's dynamic tables: rows held, admitted, evicted, ids not admitted, bytes.

Owns ``DynamicTablesCollector``, which reads, at scrape time, the figures
each dynamic table part on the shard keeps anyway
(``paramserver.shards.server.dynamic.DynamicRows.stats``, through the callable the
runtime gives it), so lookups and pushes record nothing for metrics.  A part
is labelled with its table and ``part``, ``"index/count"``: which of the
table's shards this process serves.  It never touches a tensor and imports
nothing of the data plane.
"""

from typing import Callable, Iterable, Iterator, Mapping, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: One part's figures: ``(table, "index/count", {"rows", "admitted", "evicted", "not_admitted", "bytes"})``.
PartStats = Tuple[str, str, Mapping[str, int]]

_LABELS = ["table", "part"]


class DynamicTablesCollector(Collector):
    """The dynamic table parts that ``parts()`` lists (none before the shard serves)."""

    def __init__(self, parts: Callable[[], Iterable[PartStats]]):
        self._parts = parts

    def collect(self) -> Iterator[Metric]:
        rows = GaugeMetricFamily("paramserver_dynamic_rows", "Rows this shard holds of a dynamic table",
                                 labels=_LABELS)
        admitted = CounterMetricFamily("paramserver_dynamic_rows_admitted",
                                       "Rows made for ids admitted to a dynamic table on this shard (an id "
                                       "evicted and admitted again counts again; rows restored from a "
                                       "checkpoint do not count)", labels=_LABELS)
        evicted = CounterMetricFamily("paramserver_dynamic_rows_evicted",
                                      "Rows of a dynamic table evicted on this shard (capacity or TTL)",
                                      labels=_LABELS)
        not_admitted = CounterMetricFamily("paramserver_dynamic_rows_not_admitted",
                                           "Ids a training lookup of a dynamic table left without a row on this "
                                           "shard (below the admission bar, or no room), once per lookup",
                                           labels=_LABELS)
        memory = GaugeMetricFamily("paramserver_dynamic_bytes",
                                   "Bytes of a dynamic table's rows on this shard: rows, ids, touches, index and "
                                   "admission counts (optimizer state not included)", labels=_LABELS)
        for table, part, stats in self._parts():
            labels = [table, part]
            rows.add_metric(labels, stats["rows"])
            admitted.add_metric(labels, stats["admitted"])
            evicted.add_metric(labels, stats["evicted"])
            not_admitted.add_metric(labels, stats["not_admitted"])
            memory.add_metric(labels, stats["bytes"])
        yield rows
        yield admitted
        yield evicted
        yield not_admitted
        yield memory
