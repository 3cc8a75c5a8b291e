"""Which metrics each kind of process serves, from start to close.

Owns ``ProcessMetrics``: a process's registry, its exporter, and the
metric sets it serves (the coordinator: ``cluster``; a shard:
``data_plane`` and, read from its state, ``dynamic_tables``; a worker:
``data_plane`` and ``training``, plus the running job's figures).  The
runtime (``paramserver.runtime``) starts one per process when given
``--metrics-port`` and hands its ``data_plane`` and ``training`` sets to
what records into them (a shard's ``ShardState``, a worker's
``JobContext``); nothing here is process-wide, so tests start several in
one process.
"""

from typing import Callable, Iterable, Mapping, Optional

from prometheus_client import CollectorRegistry

from . import data_plane, training
from .cluster import ClusterCollector
from .dynamic_tables import DynamicTablesCollector, PartStats
from .exporter import MetricsExporter, new_registry
from .push_log import PushLogCollector
from .training import JobCollector, JobProgress


class ProcessMetrics:
    """One process's metrics, served at ``self.url`` until ``close()``.

    ``data_plane`` and ``training`` are the metric sets for the runtime to
    hand down (``None`` where this process does not serve that set).
    """

    def __init__(self, host: str, port: int, process: str, *, serves_data_plane: bool = False,
                 trains: bool = False, collectors=()):
        self.registry: CollectorRegistry = new_registry()
        self.data_plane: Optional[data_plane.DataPlaneMetrics] = None
        self.training: Optional[training.TrainingMetrics] = None
        for collector in collectors:
            self.registry.register(collector)
        if serves_data_plane:
            self.data_plane = data_plane.DataPlaneMetrics(self.registry)
        if trains:
            self.training = training.TrainingMetrics(self.registry)
        self.exporter = MetricsExporter(host, port, self.registry, process)
        self.port, self.url = self.exporter.port, self.exporter.url

    def watch_job(self, job: JobProgress) -> None:
        """Serve ``job``'s reported step and figures from now on."""
        self.registry.register(JobCollector(job))

    def close(self) -> None:
        """Stop serving (what was handed its metric sets may go on recording into them, unread)."""
        self.exporter.close()


def coordinator_metrics(host: str, port: int, membership, checkpoints=None) -> ProcessMetrics:
    """``ps-server``'s own process: the cluster as the coordinator sees it."""
    return ProcessMetrics(host, port, "the coordinator", collectors=[ClusterCollector(membership, checkpoints)])


def shard_metrics(host: str, port: int, name: str,
                  dynamic_tables: Callable[[], Iterable[PartStats]] = lambda: (),
                  push_log: Callable[[], Optional[Mapping[str, float]]] = lambda: None) -> ProcessMetrics:
    """A shard server process: the optimizer steps it applies and who asked for them; the rows of the dynamic
    table parts that ``dynamic_tables()`` lists at each scrape; its push log's figures (``push_log()``)."""
    return ProcessMetrics(host, port, name, serves_data_plane=True,
                          collectors=[DynamicTablesCollector(dynamic_tables), PushLogCollector(push_log)])


def worker_metrics(host: str, port: int) -> ProcessMetrics:
    """A ``ps-worker``: its RPCs to the shards, its training, its job's figures (``watch_job``)."""
    return ProcessMetrics(host, port, "this worker", serves_data_plane=True, trains=True)
