"""Metrics of a worker's training: steps, DDP comm-hook bytes, its trainer group, the job's figures.

Owns the definitions and the recording functions that the trainer side
calls when this process serves metrics and they were handed a
``TrainingMetrics`` (a ``Trainer`` hands its context's on):
``paramserver.ddp.hooks``' comm-hook state at the end of every backward
pass (``hook_step``), ``paramserver.ddp.replica`` at every finished step
(``step_finished``), ``paramserver.ddp.group`` when a generation of the
trainer group forms (``group_formed``);
and ``JobCollector``, which reads a running job's reported step and
figures (``JobContext.report``) at scrape time, so reporting costs nothing
more.  Hook bytes and hook steps are counted together under one lock and
read together, so that one scrape always sees bytes and steps of the same
backward passes.  It never touches a tensor or a process group.
"""

import threading
from typing import Dict, Iterator, List, Protocol, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class TrainingMetrics:
    """A worker's training metrics in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.steps = Counter("paramserver_training_steps_total",
                             "Training steps this worker's dense replica completed (DenseReplica.finish_step)",
                             registry=registry)
        self.group_generation = Gauge("paramserver_trainer_group_generation",
                                      "Generation of this worker's trainer group last formed here", ["group"],
                                      registry=registry)
        self._hooks_lock = threading.Lock()
        self._hooks: Dict[str, List[int]] = {}  # hook name -> [backward passes, bytes]
        registry.register(_HookCollector(self))

    def hook_step(self, hook: str, step_bytes: int) -> None:
        """A backward pass through comm hook ``hook`` ended, having handed ``step_bytes`` to all-reduce."""
        with self._hooks_lock:
            totals = self._hooks.setdefault(hook, [0, 0])
            totals[0] += 1
            totals[1] += step_bytes

    def hook_totals(self) -> Dict[str, Tuple[int, int]]:
        """``{hook: (backward passes, bytes)}``, read together."""
        with self._hooks_lock:
            return {hook: (steps, sent) for hook, (steps, sent) in self._hooks.items()}

    def step_finished(self) -> None:
        self.steps.inc()

    def group_formed(self, group: int, generation: int) -> None:
        self.group_generation.labels(str(group)).set(generation)


class _HookCollector(Collector):
    def __init__(self, metrics: TrainingMetrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        steps = CounterMetricFamily("paramserver_comm_hook_steps",
                                    "Backward passes whose gradients went through the DDP comm hook", labels=["hook"])
        sent = CounterMetricFamily("paramserver_comm_hook_bytes",
                                   "Payload bytes the DDP comm hook handed to all-reduce (per rank), in completed "
                                   "backward passes", labels=["hook"])
        for hook, (count, total) in sorted(self._metrics.hook_totals().items()):
            steps.add_metric([hook], count)
            sent.add_metric([hook], total)
        yield steps
        yield sent


class JobProgress(Protocol):
    """What ``JobCollector`` reads: ``paramserver.runtime.JobContext.progress()``."""

    def progress(self) -> Tuple[int, Dict[str, float]]: ...


class JobCollector(Collector):
    """The job's last reported step and figures (loss, samples_per_s...), read at scrape time."""

    def __init__(self, job: JobProgress):
        self._job = job

    def collect(self) -> Iterator[Metric]:
        step, figures = self._job.progress()
        yield GaugeMetricFamily("paramserver_job_step", "The last step the job reported", value=step)
        family = GaugeMetricFamily("paramserver_job_figure",
                                   "The figures the job reported with its last step (ctx.report), by name",
                                   labels=["figure"])
        for name, value in sorted(figures.items()):
            family.add_metric([name], value)
        yield family
