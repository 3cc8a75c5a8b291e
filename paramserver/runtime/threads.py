"""How many threads each process of a cluster gives PyTorch: sized to its host, not to every core.

Owns choosing and applying a process's intra-op and inter-op thread
counts.  By default PyTorch gives every process one intra-op thread per
core; a host running a coordinator, several shard servers and several
workers then runs several times more busy threads than it has cores, and
training slows down as workers are added.  Here:

* the cores a process may use are its CPU affinity, capped by its
  cgroup's CPU quota (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``
  over ``cpu.cfs_period_us``): a container limited to 4 CPUs counts 4;
* they are shared by the cluster's processes on the host: as many as the
  coordinator counts there (``Assignment.host_processes``, then each
  heartbeat's answer: every member says its machine when it joins,
  ``control.machine``), however they were started, and at least the tasks
  Slurm runs on this node (``SLURM_NTASKS_PER_NODE``, else this node's
  entry of ``SLURM_TASKS_PER_NODE``; 1 where each task is bound to CPUs of
  its own); ``PARAMSERVER_HOST_PROCESSES`` overrides (``ps-demo`` sets it);
  1 where nothing says more;
* a worker takes its share (``cores // processes``, at least 1) for its
  dense layers; a shard server and the coordinator take 1 intra-op
  thread: a shard gets its parallelism from concurrent RPC threads, from
  running several shards, and from its inter-op pool, which applies a
  large push's rows in parts at once (``shards/server/optimizers.py``) and
  is its share of the cores; a per-op pool would fight them for cores;
  the coordinator does no tensor work;
* ``PARAMSERVER_THREADS`` and ``PARAMSERVER_INTEROP_THREADS`` (or
  ``--threads`` of ``ps-server``/``ps-worker``) override.

Whether the host has cores to spare (more than the cluster's processes on
it: ``ThreadChoice.cores_to_spare``) is read here too, by what trades CPU
for latency.

``HostThreads`` sets them once, before any parallel work (PyTorch fixes
its inter-op pool at first use), and logs the choice in one line; as
members on the host join and leave, a worker's intra-op threads follow
(``HostThreads.follow``, from the thread that runs the job: OpenMP keeps
the count per thread) with a line each time they change.  The inter-op
pool cannot be resized once started, and a shard's and the coordinator's
intra-op count does not depend on the count.
"""

import logging
import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

logger = logging.getLogger(__name__)

THREADS_ENV = "PARAMSERVER_THREADS"
INTEROP_THREADS_ENV = "PARAMSERVER_INTEROP_THREADS"
HOST_PROCESSES_ENV = "PARAMSERVER_HOST_PROCESSES"
ROLES = ("worker", "shard", "coordinator")
_CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class ThreadChoice:
    intra_op: int
    inter_op: int
    cores: int
    cores_from: str
    host_processes: int
    overridden: bool

    @property
    def cores_to_spare(self) -> bool:
        """Whether the host has more cores than the cluster's processes on it: each can run on a core of its
        own, so a step waits on its messages' latency more than on CPU (the row cache's default window,
        ``paramserver.train.pipeline.default_window``, follows this)."""
        return self.cores > self.host_processes

    def describe(self, role: str) -> str:
        how = ("as set by the environment" if self.overridden else
               f"{self.cores} cores ({self.cores_from}) shared by {self.host_processes} process"
               f"{'es' if self.host_processes != 1 else ''} of this host, as a {role}")
        return f"{self.intra_op} intra-op and {self.inter_op} inter-op threads: {how}"


def cgroup_cpu_limit(root: str = _CGROUP_ROOT) -> Optional[float]:
    """The CPUs this process's cgroup may use (quota over period), or ``None`` when it sets no limit."""
    try:
        with open(os.path.join(root, "cpu.max")) as limit:  # cgroup v2: "max 100000" or "200000 100000"
            quota, period = limit.read().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as quota_file, \
                open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as period_file:
            quota, period = int(quota_file.read()), int(period_file.read())
            return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def host_cores(cgroup_root: str = _CGROUP_ROOT) -> Tuple[int, str]:
    """The cores this process may use, and what set that number."""
    try:
        cores, source = len(os.sched_getaffinity(0)), "CPU affinity"
    except AttributeError:  # pragma: no cover - not Linux
        cores, source = os.cpu_count() or 1, "the machine"
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None and limit < cores:
        cores, source = max(1, int(limit)), f"cgroup CPU quota {limit:g}"
    return cores, source


def _positive_env(name: str, environ) -> Optional[int]:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def slurm_tasks_on_node(environ: Mapping[str, str], cores: int) -> Optional[int]:
    """The tasks of this Slurm job step that run on this node (``None``: not under Slurm, or it does not say);
    1 where Slurm bound each task to CPUs of its own (its affinity, ``cores``, is fewer than the node's CPUs
    allotted to the job, ``SLURM_CPUS_ON_NODE``): then they share nothing."""
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
    tasks: Optional[int] = int(per_node) if per_node.isdigit() and int(per_node) > 0 else None
    if tasks is None:
        counts = _slurm_task_counts(environ.get("SLURM_TASKS_PER_NODE", ""))
        node = environ.get("SLURM_NODEID", "")
        if counts:
            tasks = counts[int(node)] if node.isdigit() and int(node) < len(counts) else max(counts)
    if tasks is None:
        return None
    allotted = environ.get("SLURM_CPUS_ON_NODE", "")
    if tasks > 1 and allotted.isdigit() and cores < int(allotted):
        return 1
    return tasks


def _slurm_task_counts(value: str) -> List[int]:
    """``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) as one count per node (``[2, 2, 2, 1]``); [] if malformed."""
    counts: List[int] = []
    for part in value.split(",") if value else ():
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def choose_threads(role: str, environ=None, cores: Optional[Tuple[int, str]] = None,
                   cluster_processes: int = 0) -> ThreadChoice:
    """The threads a process of ``role`` (``ROLES``) should use; ``cluster_processes``: the cluster's processes on
    this host as the coordinator counts them (0: unknown).  See the module's docstring."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    environ = os.environ if environ is None else environ
    count, source = cores or host_cores()
    processes = _positive_env(HOST_PROCESSES_ENV, environ) or max(
        1, cluster_processes, slurm_tasks_on_node(environ, count) or 1)
    share = max(1, count // processes)
    intra = share if role == "worker" else 1
    inter = share if role == "shard" else min(2, intra)
    intra_override, inter_override = _positive_env(THREADS_ENV, environ), _positive_env(INTEROP_THREADS_ENV, environ)
    return ThreadChoice(intra_op=intra_override or intra, inter_op=inter_override or inter, cores=count,
                        cores_from=source, host_processes=processes,
                        overridden=intra_override is not None or inter_override is not None)


class HostThreads:
    """A process's threads: chosen and given to PyTorch once (``apply``), then followed as the cluster's
    processes on its host change (``follow``).  ``name``: this process, as its log lines say."""

    def __init__(self, role: str, name: str, environ=None, cores: Optional[Tuple[int, str]] = None):
        self.role, self.name = role, name
        self._environ, self._cores = environ, cores
        self.choice: Optional[ThreadChoice] = None

    def apply(self, cluster_processes: int = 0) -> ThreadChoice:
        """Choose the threads for ``cluster_processes`` (0: unknown), give them to PyTorch, log the choice."""
        import torch

        self.choice = choose_threads(self.role, self._environ, self._cores, cluster_processes)
        torch.set_num_threads(self.choice.intra_op)
        try:
            torch.set_num_interop_threads(self.choice.inter_op)
        except RuntimeError:  # its pool already started (an earlier parallel op): keep it
            pass
        logger.info("%s: %s", self.name, self.choice.describe(self.role))
        return self.choice

    def follow(self, cluster_processes: int) -> None:
        """The host's count changed to ``cluster_processes`` (0: unknown, nothing changes): set the intra-op
        threads it gives, on the calling thread (OpenMP keeps the count per thread: call it from the thread
        that does the work), with a line when they change.  The inter-op pool keeps its size."""
        if self.choice is None or not cluster_processes or cluster_processes == self.choice.host_processes:
            return
        choice = choose_threads(self.role, self._environ, self._cores or (self.choice.cores, self.choice.cores_from),
                                cluster_processes)
        if choice.host_processes == self.choice.host_processes:  # set by the environment or Slurm: not ours
            return
        changed = choice.intra_op != self.choice.intra_op
        self.choice = ThreadChoice(intra_op=choice.intra_op, inter_op=self.choice.inter_op, cores=choice.cores,
                                   cores_from=choice.cores_from, host_processes=choice.host_processes,
                                   overridden=choice.overridden)
        if changed:
            import torch

            torch.set_num_threads(self.choice.intra_op)
            logger.info("%s: now %s", self.name, self.choice.describe(self.role))


def apply_threads(role: str, name: str, cluster_processes: int = 0) -> ThreadChoice:
    """Choose ``role``'s threads, give them to PyTorch, and log the choice once (``name``: this process)."""
    return HostThreads(role, name).apply(cluster_processes)
