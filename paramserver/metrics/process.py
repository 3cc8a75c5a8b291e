"""Which metrics each kind of process serves, from start to close.

Owns ``ProcessMetrics``: a process's registry, its exporter, and the
metric sets installed as the process's active ones while it serves
(the coordinator: ``cluster``; a shard: ``data_plane`` and, read from
its state, ``dynamic_tables``; a worker:
``data_plane`` and ``training``, plus the running job's figures).  The
runtime (``paramserver.runtime``) starts one per process when given
``--metrics-port``; nothing here is global until then, and ``close()``
puts back what was active before (tests start several in one process).
"""

from typing import Callable, Iterable, List, Optional

from prometheus_client import CollectorRegistry

from . import data_plane, training
from .cluster import ClusterCollector
from .dynamic_tables import DynamicTablesCollector, PartStats
from .exporter import MetricsExporter, new_registry
from .training import JobCollector, JobProgress


class ProcessMetrics:
    """One process's metrics, served at ``self.url`` until ``close()``."""

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
        # Active from now until close() (not tied to this object's life: a process may drop it).
        self._uninstall: List[Callable[[], None]] = []
        for slot, metrics in ((data_plane.slot, self.data_plane), (training.slot, self.training)):
            if metrics is not None:
                self._uninstall.append(_installer(slot, metrics))
        self.port, self.url = self.exporter.port, self.exporter.url

    def watch_job(self, job: JobProgress) -> None:
        """Serve ``job``'s reported step and figures from now on."""
        self.registry.register(JobCollector(job))

    def close(self) -> None:
        """Stop serving; the metric sets active before this one are active again."""
        self.exporter.close()
        while self._uninstall:
            self._uninstall.pop()()


def _installer(slot, metrics) -> Callable[[], None]:
    """Make ``metrics`` the slot's active instance; returns how to put back the previous one (unless
    another was installed since)."""
    previous = slot.install(metrics)

    def uninstall() -> None:
        if slot.active is metrics:
            slot.install(previous)
    return uninstall


def coordinator_metrics(host: str, port: int, membership, checkpoints=None) -> ProcessMetrics:
    """``ps-server``'s own process: the cluster as the coordinator sees it."""
    return ProcessMetrics(host, port, "the coordinator", collectors=[ClusterCollector(membership, checkpoints)])


def shard_metrics(host: str, port: int, name: str,
                  dynamic_tables: Callable[[], Iterable[PartStats]] = lambda: ()) -> ProcessMetrics:
    """A shard server process: the optimizer steps it applies and who asked for them; the rows of the dynamic
    table parts that ``dynamic_tables()`` lists at each scrape."""
    return ProcessMetrics(host, port, name, serves_data_plane=True,
                          collectors=[DynamicTablesCollector(dynamic_tables)])


def worker_metrics(host: str, port: int) -> ProcessMetrics:
    """A ``ps-worker``: its RPCs to the shards, its training, its job's figures (``watch_job``)."""
    return ProcessMetrics(host, port, "this worker", serves_data_plane=True, trains=True)
