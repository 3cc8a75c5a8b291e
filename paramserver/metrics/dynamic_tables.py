"""Metrics of a shard's dynamic tables: rows held, admitted, evicted, ids not admitted, bytes; and of their row
store: lookups' ids found in memory, rows read back from disk and written there, their bytes, the reads' times,
the rows and bytes on disk.

Owns ``DynamicTablesCollector``, which reads, at scrape time, the figures
each dynamic table part on the shard keeps anyway
(``paramserver.shards.server.dynamic.DynamicRows.stats``, through the callable the
runtime gives it), so lookups and pushes record nothing for metrics.  A part
is labelled with its table and ``part``, ``"index/count"``: which of the
table's shards this process serves.  The ``paramserver_row_store_*``
metrics are there for the parts with a row store (``ps-server
--row-store``).  It never touches a tensor and imports nothing of the data
plane.
"""

from typing import Callable, Iterable, Iterator, Mapping, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

#: One part's figures: ``(table, "index/count", {"rows", "admitted", "evicted", "not_admitted", "bytes"})``,
#: with a row store's too (``rows_on_disk``, ``disk_bytes``, ``memory_hits``, ``store_reads``, ``store_writes``,
#: ``store_read_bytes``, ``store_written_bytes``, and ``store_read_latency``: an object with ``buckets``,
#: cumulative ``(upper bound, reads)`` pairs ending at +Inf, and ``sum_seconds``).
PartStats = Tuple[str, str, Mapping[str, object]]

_LABELS = ["table", "part"]


class DynamicTablesCollector(Collector):
    """The dynamic table parts that ``parts()`` lists (none before the shard serves)."""

    def __init__(self, parts: Callable[[], Iterable[PartStats]]):
        self._parts = parts

    def collect(self) -> Iterator[Metric]:
        rows = GaugeMetricFamily("paramserver_dynamic_rows", "Rows this shard holds of a dynamic table in memory",
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
        parts = list(self._parts())
        for table, part, stats in parts:
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
        yield from _row_store_metrics(parts)


#: The row store's counters and gauges: (metric, its kind, ``DynamicRows.stats`` key, help).
_ROW_STORE_FIGURES = (
    ("paramserver_row_store_memory_hits", CounterMetricFamily, "memory_hits",
     "Ids of a dynamic table's training lookups found in memory on this shard (with its row store: its hit rate "
     "is hits / (hits + rows read))"),
    ("paramserver_row_store_rows_read", CounterMetricFamily, "store_reads",
     "Rows of a dynamic table read back from this shard's row store into memory (ids that were on disk)"),
    ("paramserver_row_store_rows_written", CounterMetricFamily, "store_writes",
     "Rows of a dynamic table written to this shard's row store (evicted from memory for capacity)"),
    ("paramserver_row_store_read_bytes", CounterMetricFamily, "store_read_bytes",
     "Bytes of records a dynamic table's row store read on this shard (rows and optimizer state; reads ahead "
     "too)"),
    ("paramserver_row_store_written_bytes", CounterMetricFamily, "store_written_bytes",
     "Bytes of records written to a dynamic table's row store on this shard"),
    ("paramserver_row_store_read_ahead_waits", CounterMetricFamily, "store_waits",
     "Lookups of a dynamic table on this shard that waited for the read ahead of their rows on disk (the disk "
     "did not keep up with the push before them)"),
    ("paramserver_row_store_rows", GaugeMetricFamily, "rows_on_disk",
     "Rows of a dynamic table this shard's row store holds on disk"),
    ("paramserver_row_store_disk_bytes", GaugeMetricFamily, "disk_bytes",
     "Bytes of the files of a dynamic table's row store on this shard"),
)


def _row_store_metrics(parts: Iterable[PartStats]) -> Iterator[Metric]:
    """The ``paramserver_row_store_*`` metrics of the parts with a row store (none without)."""
    stored = [(table, part, stats) for table, part, stats in parts if "rows_on_disk" in stats]
    if not stored:
        return
    families = [(kind(name, documentation, labels=_LABELS), key)
                for name, kind, key, documentation in _ROW_STORE_FIGURES]
    latency = HistogramMetricFamily("paramserver_row_store_read_seconds",
                                    "Time of one read of a dynamic table's row store on this shard (the ids a "
                                    "lookup or a push did not find in memory, or a read ahead of the next "
                                    "lookup's)", labels=_LABELS)
    for table, part, stats in stored:
        for family, key in families:
            family.add_metric([table, part], stats[key])
        reads = stats["store_read_latency"]
        latency.add_metric([table, part], [(floatToGoString(bound), count) for bound, count in reads.buckets],
                           reads.sum_seconds)
    for family, _ in families:
        yield family
    yield latency
