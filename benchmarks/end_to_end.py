"""End-to-end training throughput of the default job: this framework vs plain torch RPC + DDP vs one process.

What it measures
    Samples per second of the default CTR job (``paramserver/jobs/ctr.py``) trained on
    this machine, in one run: two distributed ways with the same shape, and
    the floor of both, the same model in one process.  The distributed ones: 4 parameter-server
    processes, 2 trainers in one DDP group (gloo), the 8 tables of
    ``CTRSpec()`` (same vocabulary sizes, dimension 16, "sum" for one id per
    sample, "mean" for bags), the same MLP (``paramserver.jobs.ctr.dense_tower``), the
    same batches (``PlantedCTR(seed=0).batch(trainer, step, batch)``) and the
    same update (QHM with the job's defaults: sparse lr 128, dense lr 0.5,
    momentum 0.9, nu 0.7; tables start N(0, 0.01)):

    * **paramserver**: ``ps-demo --hook allreduce`` (``python -m
      paramserver.cli.demo``: ps-server with 4 shard servers, 2 ps-workers,
      the gRPC control plane), its final JSON line's samples_per_s.  The
      allreduce hook is plain DDP all-reduce, like the reference's.  Its
      tables are placed by the Trainer (``placement.pack_whole``: the eight
      small tables on 2 of the 4 shards, so a step sends 2 messages per
      worker); the reference's by its design, one per table round-robin,
      which does not change its message count (one RPC per table either
      way).
    * **torch RPC+DDP reference** (``benchmarks/reference_hybrid.py``): the
      structure of PyTorch's tutorial "Combining Distributed DataParallel with
      Distributed RPC Framework".  A master process creates one
      ``torch.distributed.nn.RemoteModule(nn.EmbeddingBag)`` per table, whole,
      round-robin on ps0..ps3, and hands them to the trainers by RPC; each
      trainer runs its loop in that RPC call: lookups by RPC inside a
      ``dist_autograd`` context (the 8 tables' ``forward_async`` at once, as
      our job overlaps its lookups), the tower wrapped in DDP,
      ``dist_autograd.backward``, then
      ``torch.distributed.optim.DistributedOptimizer`` steps the tables'
      ``remote_parameters()`` and the tower's parameters passed as ``RRef``s of
      local parameters, as the tutorial does.  Two DistributedOptimizers (one
      for the tables, one for the tower) because torch's gives every parameter
      the same learning rate and the job uses two.  For the same update on
      both sides, ``paramserver.optim.FunctionalQHM`` is registered for
      ``paramserver.optim.QHM`` in torch's own ``functional_optim_map``
      (``torch.distributed.optim.utils.register_functional_optim``), so torch's
      owners run the same TorchScript QHM our shard servers run.
      Its strongest fair set-up: ``EmbeddingBag(sparse=True)`` (row-sparse
      gradients, the tables' owners update only the rows a step touched),
      parameter servers with one intra-op thread (as our shard servers), and
      TensorPipe's ``uv`` transport (``_transports=["uv"]``), which our
      cluster uses (``paramserver.shards.peer.OPEN_GROUP_TRANSPORTS``): the
      default, shared memory, polls, and with 7 processes on 2 cores every
      idle peer's polling thread would eat the cores (``PeerOptions``'
      docstring measures ~4x slower training with it), which would make the
      reference look worse for a reason that is not its design.
    * **floor** (``benchmarks/local_floor.py``): the same model, batches
      and update trained in one process at the global batch (2 x
      ``--batch`` samples a step: both workers' batches), no RPC, no DDP:
      ``EmbeddingBag(sparse=True)`` tables stepped on the touched rows by
      ``FunctionalQHM`` (as the shards step them), the tower by ``QHM``.
      What a sample costs beyond it is the price of distribution.
    * **tutorial's dense-gradient variant** (unless ``--no-dense-variant``):
      the same reference with the tutorial's literal ``EmbeddingBag()``
      (``sparse=False``): each table owner's backward materialises a gradient
      of its whole table and the optimizer steps every row (QHM's momentum
      then moves rows the step did not touch: not the same math).  The
      gradient travelling over RPC is still only the pooled outputs'.

    Throughput is measured the same way on every side, after a warm-up: per
    trainer, samples over the wall time from step ``--warmup`` (default 100)
    to the end of its last step (the batch's generation included; process
    start, table creation and the warm-up steps excluded: the first steps
    run 20-40% slower, while TorchScript compiles the optimizers where first
    used, the allocator, the caches and the other processes' start-up
    settle), summed over the two trainers; the floor's is its one loop's,
    the same way.  Ours is read from the workers' logs: the Trainer logs its
    running samples/s every ``--log-every`` steps, so a worker's window runs
    from the first step it logs at or after the warm-up to its last
    (``window_rate``); the reference's trainers and the floor time their own
    window.  Each round runs every contestant once, one after the other (the
    order reversed every other round), after the processes of the one
    before are gone; each row gives the median of the rounds, the min, the
    max, and the spread (how far the run farthest from the median is from
    it, in % of the median), and the ratios and verdicts are of the medians.
    Final loss: mean training loss of the last ``--log-every`` steps (ours:
    ps-demo's figure, one worker's; reference: the mean of both trainers'), a
    check that both learn the same thing.  Close, not equal: the tables start
    from other random draws, and server-side updates are asynchronous.  The
    reference's momentum is per trainer (torch's DistributedOptimizer builds
    one optimizer per trainer on each owner, and steps them without a lock),
    ours is one per parameter, shared.  The floor's is the mean of its last
    steps' losses over the global batch.

    Threads, fairly: every contestant has the whole host.  By default the
    floor, one process, gets every core (``host_cores()``: the CPU affinity,
    capped by the cgroup quota) as intra-op threads; a distributed run has 7
    processes on the host, and each gets what ``paramserver.runtime.threads``
    gives it (ps-demo's own sizing): a trainer ``cores // 7`` (at least 1),
    a server (shard, parameter server) and the coordinator (or master) 1;
    the reference's processes get the same by role.  ``--threads N`` gives
    every process of every contestant N intra-op threads instead (ours:
    ``PARAMSERVER_THREADS`` and ``OMP_NUM_THREADS``, which size shards and
    coordinator too).  The header prints what each contestant ran.

    CPU seconds per 1,000 samples by kind of process: where a sample's cost
    goes, next to the floor's.  ``process_cpu`` follows this benchmark's
    descendants in ``/proc`` by parent pid and keeps each process's last
    utime + stime; ours' kinds come from their command lines (``python -m
    paramserver.cli.demo`` the driver, ``.server`` the coordinator, with its
    fork server and resource tracker, ``.worker`` a worker; a process forked
    by the coordinator's fork server a shard), the reference's processes name
    themselves (``master``, ``psN``, ``trainerN``).  Counted over the timed
    window: from when both trainers are past the warm-up (ours: the Trainer's
    "step W/N" log line; the reference's: a file each trainer touches) to
    when both have trained their last step (ours: the last "step S/N" line
    before the last step, since rank 0 logs the last after its held-out
    evaluation; the reference's: another file), so imports, start-up, the
    warm-up, the evaluation, the export and the exit are left out (the header
    of the table says if the start was not seen),
    and divided by the samples trained in it.  The processes are read every half
    second and once more at each end of the window.  The floor's is its own
    process's over its timed loop.

How to run
    ``.venv/bin/python benchmarks/end_to_end.py [--steps N] [--warmup N] [--batch N]
    [--repeats N] [--log-every N] [--threads N] [--staleness K]
    [--cache-rows N [--cache-steps L]] [--sparse-optimizer NAME] [--no-dense-variant]``; the defaults
    (600 steps of which 100 warm-up, batch 1024 per trainer, 3 rounds;
    ``--rounds`` is another name of ``--repeats``) take about 6-7 minutes on
    2 cores, 4 with ``--no-dense-variant``.  ``--staleness K`` is for ours only: the job configuration gets
    ``"staleness": K`` (without the flag the key is not set: the job's
    default); ``--cache-rows N`` adds the workers' row cache (``"cache_rows":
    N``, and ``"cache_steps": L`` with ``--cache-steps``), whose figures
    (hit rate, rows read, bytes saved, evictions) follow the tables.
    ``--sparse-optimizer NAME`` is for ours only too: the job configuration
    gets ``"sparse_optimizer": NAME`` (``qhm``, the job's default, ``sgd``,
    ``adagrad``, ``rowwise_adagrad``, ``adam``, ``ftrl``: the names of
    ``paramserver.jobs.ctr.SPARSE_OPTIMIZERS``, each at its tuned learning
    rate), so that the default job can be compared across optimizers; the
    floor and the reference still run QHM, so with another name the rows
    compare cost, not the same update.  Every
    run of ours also prints how much a worker's resident memory grew over
    training (its largest reading after the first step, minus its reading
    then).  Progress goes to stderr, results to stdout.

How to read it
    vs reference: a row's samples/s over the sparse reference's, same run;
    vs floor: over the floor's, same run.
    The step phases of each side (trainer means) show where its time goes
    (ours: the Trainer's ``phase_ms:`` figures, ``paramserver.train.step.PHASES``;
    its push is sent right after the backward pass and waited for after
    the dense optimizer's step; and within the backward, how long the
    last gradient bucket's all-reduce was in flight: the wait for the
    other worker, then the transfer); ms/step is per trainer (2 x batch / samples/s).  This machine is
    shared and noisy: compare runs, not digits; the header's load averages
    (1 minute, before and after) help tell whether something else was
    running (the run itself keeps 7-8 processes busy).  With more processes
    than cores, throughput is set by the CPU time a step costs over all
    processes, trainers and servers alike.  The targets (ours at least 2x
    the reference; at least 0.6x the floor, 0.9x with ``--staleness`` above
    0) say PASS or BELOW, and so does the figures' own: every run of every
    contestant within 10% of its median; the script exits 0 either way, 1 if
    a contestant failed.
"""

import argparse
import datetime
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # reference_hybrid, also in spawned children

import local_floor  # noqa: E402
import reference_hybrid  # noqa: E402
from local_floor import JOB_DEFAULTS  # noqa: E402
from process_cpu import PollingThread, ProcessTreeCPU  # noqa: E402

from paramserver.jobs.ctr import SPARSE_OPTIMIZERS  # noqa: E402
from paramserver.processes import Child, ChildProcessesFailed, free_port, run_children  # noqa: E402
from paramserver.runtime.threads import HOST_PROCESSES_ENV, THREADS_ENV, choose_threads, host_cores  # noqa: E402
from paramserver.train.step import PHASES  # noqa: E402
from paramserver.train.trainer import ALLREDUCE_FIGURE, PHASE_FIGURE, ROW_CACHE_FIGURE  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Targets: ours over the reference; ours over the floor, without and with staleness.
REFERENCE_TARGET, FLOOR_TARGET, FLOOR_TARGET_STALE = 2.0, 0.6, 0.9
#: Target of the figures themselves: every run of a contestant within this % of its median.
SPREAD_TARGET_PCT = 10.0
#: Defaults: steps per trainer, of which the first are warm-up (not timed), and rounds.
DEFAULT_STEPS, DEFAULT_WARMUP, DEFAULT_ROUNDS = 600, 100, 3
#: Seconds between two readings of every process while the CPU's window is open (its ends are read when the
#: log lines or files that mark them are seen): each reading takes the contestants' CPU too.
WATCH_INTERVAL = 2.0
#: Thread groups under this many CPU seconds per 1,000 samples are left out of the table by thread.
THREAD_ROW_AT_LEAST = 0.00005
#: How long to wait, before a contestant starts, for the processes of the one before to be gone.
SETTLE_WITHIN = 30.0
OURS, FLOOR, REFERENCE, DENSE = "paramserver", "floor", "reference", "dense"
LABELS = {
    OURS: "paramserver (ps-demo, allreduce hook)",
    FLOOR: "floor: one process, no RPC, no DDP (local_floor.py)",
    REFERENCE: "torch RPC+DDP reference (RemoteModule EmbeddingBag sparse=True)",
    DENSE: "torch RPC+DDP, tutorial's dense-gradient EmbeddingBag",
}
DEMO_STOPS_WITHIN = 30.0
#: Processes of one distributed run on this host (ours: coordinator, shards, workers; the reference's:
#: master, parameter servers, trainers): the share of the cores each gets by default.
DISTRIBUTED_PROCESSES = 1 + reference_hybrid.NUM_PS + reference_hybrid.TRAINERS
#: Kinds of process whose CPU is counted, per contestant: (row label, ours' kind, the reference's kind).
CPU_ROWS = (("trainers (ps-worker / trainer)", "worker", "trainer"),
            ("servers (shard / ps)", "shard", "ps"),
            ("coordinator (ps-server) / master", "coordinator", reference_hybrid.MASTER),
            ("driver (ps-demo)", "driver", None))
#: How a process of ours shows on its command line: (``python -m`` module, kind).
DEMO_MODULES = (("paramserver.cli.demo", "driver"), ("paramserver.cli.server", "coordinator"),
                ("paramserver.cli.worker", "worker"))
FORK_SERVER = "multiprocessing.forkserver"


def progress(message: str) -> None:
    print(f"[end_to_end] {message}", file=sys.stderr, flush=True)


class ContestantFailed(RuntimeError):
    """One side of the comparison did not finish; the message says why."""


def process_kind(cmdline: str, name: str, parent_cmdline: str, parent_kind: str) -> Optional[str]:
    """The kind of a process under this benchmark (``process_cpu.Classify``): the reference's processes
    name themselves; ps-demo's exec ``python -m paramserver.cli.*``; a child of ps-server's fork server
    (it has the fork server's command line) is a shard; anything else counts as its parent."""
    if name in reference_hybrid.process_names():
        return reference_hybrid.role(name)
    if FORK_SERVER in cmdline and FORK_SERVER in parent_cmdline and parent_kind == "coordinator":
        return "shard"  # ps-server's fork server starts its shard processes (paramserver.runtime.supervisor)
    for module, kind in DEMO_MODULES:
        if f"-m {module}" in cmdline:
            return kind
    return None


def watch_cpu(started: Callable[[], bool], ended: Callable[[], bool]) -> PollingThread:
    """Counts the CPU of this benchmark's descendants by kind, from when ``started()`` first holds to when
    ``ended()`` does."""
    return PollingThread(ProcessTreeCPU(os.getpid(), "benchmark", process_kind, by_thread=True), started,
                         interval=WATCH_INTERVAL, done=ended)


def settle(cpu: PollingThread) -> None:
    """Wait (``SETTLE_WITHIN`` at most) until no process that ``cpu`` saw is left: one that exits late (a shard
    of the fork server, a resource tracker) would take CPU from the next contestant's window."""
    deadline = time.monotonic() + SETTLE_WITHIN
    while cpu.tree.alive() and time.monotonic() < deadline:
        time.sleep(0.2)


def cpu_per_1000(cpu: PollingThread, samples: int) -> Dict:
    """CPU seconds per 1,000 samples of each kind counted by ``cpu``, and whether start-up and exit are left out."""
    return {"cpu_per_1000": {kind: 1e3 * seconds / samples for kind, seconds in cpu.tree.cpu_by_kind().items()},
            "thread_cpu_per_1000": {f"{kind}/{thread}": 1e3 * seconds / samples
                                    for (kind, thread), seconds in cpu.tree.cpu_by_thread().items()},
            "cpu_window": cpu.tree.marked and cpu.tree.ended, "rss_growth_mib": cpu.tree.rss_growth_by_kind()}


def threads_of(args) -> Dict[str, Dict[str, int]]:
    """Intra-op threads of every kind of process, per contestant: ``--threads`` for every process of every
    contestant; by default the floor gets every core, and each distributed run splits them as
    ``paramserver.runtime.threads`` does (trainers a share, servers and coordinator one)."""
    if args.threads:
        every = {kind: args.threads for kind in ("worker", "shard", "coordinator", *reference_hybrid.ROLES)}
        return {FLOOR: {"floor": args.threads}, OURS: every, REFERENCE: every}
    environ = {HOST_PROCESSES_ENV: str(DISTRIBUTED_PROCESSES)}
    ours = {role: choose_threads(role, environ).intra_op for role in ("worker", "shard", "coordinator")}
    return {FLOOR: {"floor": host_cores()[0]}, OURS: ours,
            REFERENCE: {reference_hybrid.MASTER: ours["coordinator"], "ps": ours["shard"], "trainer": ours["worker"]}}


def run_ours(args, folder: pathlib.Path) -> Dict:
    """``ps-demo --hook allreduce`` as a subprocess; its final JSON line's figures, and its processes' CPU
    from when both workers start their first step."""
    extra = {} if args.staleness is None else {"staleness": args.staleness}
    if args.sparse_optimizer is not None:
        extra["sparse_optimizer"] = args.sparse_optimizer
    if args.cache_rows is not None:
        extra["cache_rows"] = args.cache_rows
        if args.cache_steps is not None:
            extra["cache_steps"] = args.cache_steps
    environment = threads_environment(args.threads)
    worker_logs = [folder / "logs" / f"ps-worker{i}.log" for i in range(reference_hybrid.TRAINERS)]
    # The Trainer's "... step N/M:" lines, logged every log_every steps and at the last: the window opens at the
    # first one at or after the warm-up, and the CPU's closes at the last one before the last step (rank 0 logs
    # the last step after its held-out evaluation, which is not training).
    first, cpu_last = window_steps(args)
    started = [LogWatch(log, f" step {first}/{args.steps}:" if first else " from step ") for log in worker_logs]
    ended = [LogWatch(log, f" step {cpu_last}/{args.steps}:") for log in worker_logs]
    with watch_cpu(lambda: all(seen() for seen in started), lambda: all(seen() for seen in ended)) as cpu:
        summary = run_demo(folder, args.steps, args.batch, args.log_every, args.timeout, extra_config=extra,
                           environment=environment)
    settle(cpu)
    rates = [logged_rates(log, args.steps) for log in worker_logs]
    return dict(cpu_per_1000(cpu, (cpu_last - first) * reference_hybrid.TRAINERS * args.batch),
                samples_per_s=sum(window_rate(rate, first, args.steps, args.batch) for rate in rates),
                samples_per_s_with_warmup=summary["samples_per_s"], loss=summary["loss"],
                **step_figures(summary),
                row_cache={key[len(ROW_CACHE_FIGURE):]: value for key, value in summary.items()
                           if key.startswith(ROW_CACHE_FIGURE)})


def window_steps(args) -> tuple:
    """The steps that bound ours' timed window: the first step the Trainer logs at or after ``--warmup`` (it logs
    every ``--log-every`` steps and the last; 0, the start of its loop, when it logs none before the last step
    from there), and the last it logs before the last step (where the CPU's window closes; the last step itself
    when none is logged between)."""
    logged = range(args.log_every, args.steps, args.log_every)
    first = next((step for step in logged if step >= args.warmup), 0) if args.warmup else 0
    logged = [*logged, args.steps]
    before_last = [step for step in logged if first < step < args.steps]
    return first, (before_last[-1] if before_last else args.steps)


def logged_rates(log: pathlib.Path, steps: int) -> Dict[int, float]:
    """The Trainer's running samples/s at each step it logged (``worker0 step 150/300: loss ..., 51234
    samples/s, ...``): this worker's samples since its loop started over the time since then."""
    rates = {}
    for line in log.read_text(errors="replace").splitlines():
        marker = line.find(f"/{steps}: loss ")
        if " step " in line and marker > 0 and " samples/s" in line:
            step = int(line[:marker].rsplit(" step ", 1)[1])
            rates[step] = float(line[:line.index(" samples/s")].rsplit(" ", 1)[1])
    return rates


def window_rate(rates: Dict[int, float], first: int, last: int, batch: int) -> float:
    """One worker's samples/s from the end of step ``first`` to the end of step ``last``, from its running
    figures there: at step k it had trained k x batch samples in k x batch / rate_k seconds (the loop starts
    at step 0; the figure of the last step is taken before its held-out evaluation)."""
    if last not in rates or (first and first not in rates):
        raise ContestantFailed(f"ps-demo's worker logged no samples/s at step {first if last in rates else last}")
    seconds = last * batch / rates[last] - (first * batch / rates[first] if first else 0.0)
    return (last - first) * batch / seconds


class LogWatch:
    """Whether the log at ``path`` has said ``text`` yet, reading only what was written since the last look
    (the CPU watcher looks every 0.1 s while the contestants run: it does not read whole logs again)."""

    def __init__(self, path: pathlib.Path, text: str):
        self.path, self.text = path, text
        self._offset, self._tail, self._seen = 0, "", False

    def __call__(self) -> bool:
        if not self._seen:
            try:
                with open(self.path, "rb") as log:
                    log.seek(self._offset)
                    written = log.read()
            except OSError:  # not there yet
                return False
            self._offset += len(written)
            text = self._tail + written.decode(errors="replace")
            self._seen, self._tail = self.text in text, text[-len(self.text):]
        return self._seen


def demo_config(batch: int, log_every: int, extra_config: Optional[Dict] = None) -> Dict:
    """The job configuration ps-demo is given: held-out evaluation only at the end (the Trainer always
    evaluates its last step), the batch, the log interval, ``extra_config``."""
    return {"eval_every": 1_000_000, "log_every": log_every, "batch_size": batch, **(extra_config or {})}


def threads_environment(threads: Optional[int]) -> Dict[str, str]:
    """What gives every process of a ps-demo run ``threads`` intra-op threads (0 or None: each sizes its own to
    the host)."""
    return {THREADS_ENV: str(threads), "OMP_NUM_THREADS": str(threads)} if threads else {}


def step_figures(summary: Dict) -> Dict:
    """From a ps-demo summary: where a step's time went (``phase_ms``, by phase) and how long of its backward the
    all-reduce was in flight (``allreduce_ms``), the workers' means."""
    return {"phase_ms": {key[len(PHASE_FIGURE):]: value for key, value in summary.items()
                         if key.startswith(PHASE_FIGURE)},
            "allreduce_ms": summary.get(ALLREDUCE_FIGURE, 0.0)}


def run_demo(folder: pathlib.Path, steps: int, batch: int, log_every: int, timeout: float, *flags: str,
             watch: Optional[Callable[[pathlib.Path], None]] = None, extra_config: Optional[Dict] = None,
             environment: Optional[Dict[str, str]] = None) -> Dict:
    """``ps-demo --hook allreduce --steps STEPS [flags]`` (evaluation at the end only; ``extra_config`` added to the job
    configuration; ``environment`` added to this process's) as a subprocess, logging under ``folder``; its
    final JSON line.  ``watch(log_dir)`` is called about every 0.5 s while it runs."""
    command = [sys.executable, "-m", "paramserver.cli.demo", "--hook", "allreduce", "--steps", str(steps),
               "--job-config", json.dumps(demo_config(batch, log_every, extra_config)),
               "--log-dir", str(folder / "logs"), "--timeout", str(timeout), *flags]
    out_path, err_path = folder / "ps-demo.out", folder / "ps-demo.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        demo = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                start_new_session=True, env=dict(os.environ, **(environment or {})))
    try:
        deadline = time.monotonic() + timeout + DEMO_STOPS_WITHIN
        while demo.poll() is None and time.monotonic() < deadline:
            if watch is not None:
                watch(folder / "logs")
            time.sleep(0.5)
        code = demo.wait(max(0.1, deadline - time.monotonic()))
    finally:
        if demo.poll() is None:  # interrupted or stuck: ps-demo reaps its own children on SIGINT
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(DEMO_STOPS_WITHIN)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()
    lines = out_path.read_text().splitlines()
    if code != 0 or not lines:
        tail = "\n".join("    " + line for line in err_path.read_text(errors="replace").splitlines()[-15:])
        raise ContestantFailed(f"ps-demo exited with code {code}; its stderr ends:\n{tail}")
    return json.loads(lines[-1])


def run_floor(args, folder: pathlib.Path) -> Dict:
    """``local_floor.train`` in a child process; its figures (its CPU is its own, over its timed steps)."""
    results_path = str(folder / "floor.json")
    threads = threads_of(args)[FLOOR]["floor"]
    child = Child("floor", local_floor.train_to_file,
                  (results_path, args.steps, args.batch, reference_hybrid.TRAINERS, threads, args.log_every),
                  {"warmup": args.warmup})
    try:
        run_children([child], datetime.timedelta(seconds=args.timeout))
    except ChildProcessesFailed as error:
        raise ContestantFailed(f"the floor failed: {error}") from error
    with open(results_path) as results_file:
        result = json.load(results_file)
    samples = (args.steps - args.warmup) * reference_hybrid.TRAINERS * args.batch
    return dict(result, cpu_per_1000={"floor": 1e3 * result["cpu_seconds"] / samples}, cpu_window=True)


def run_reference(args, folder: pathlib.Path, sparse: bool) -> Dict:
    """The torch RPC + DDP reference, 7 spawned processes; the trainers' figures combined, and the
    processes' CPU from when both trainers start their first step."""
    variant = "sparse" if sparse else "dense"
    started_path, ended_path = folder / f"reference-{variant}.started", folder / f"reference-{variant}.ended"
    config = dict(JOB_DEFAULTS, steps=args.steps, batch_size=args.batch, loss_window=args.log_every,
                  sparse=sparse, transports=["uv"], threads=threads_of(args)[REFERENCE], warmup=args.warmup,
                  started_path=str(started_path), ended_path=str(ended_path))
    results_path = str(folder / f"reference-{variant}.json")
    rpc_port, ddp_port = free_port(), free_port()
    children = [Child(name, reference_hybrid.run_process, (name, rank, rpc_port, ddp_port, config, results_path))
                for rank, name in enumerate(reference_hybrid.process_names())]
    markers = [pathlib.Path(f"{started_path}.{rank}") for rank in range(reference_hybrid.TRAINERS)]
    ends = [pathlib.Path(f"{ended_path}.{rank}") for rank in range(reference_hybrid.TRAINERS)]
    try:
        with watch_cpu(lambda: all(marker.exists() for marker in markers),
                       lambda: all(marker.exists() for marker in ends)) as cpu:
            with reference_hybrid.hosted_stores(rpc_port, ddp_port):
                run_children(children, datetime.timedelta(seconds=args.timeout))
        settle(cpu)
    except ChildProcessesFailed as error:
        raise ContestantFailed(f"the reference failed: {error}") from error
    with open(results_path) as results_file:
        trainers = json.load(results_file)
    return dict(cpu_per_1000(cpu, (args.steps - args.warmup) * reference_hybrid.TRAINERS * args.batch),
                samples_per_s=sum(t["samples_per_s"] for t in trainers),
                loss=statistics.mean(t["loss"] for t in trainers),
                phase_ms={phase: statistics.mean(t["phase_ms"][phase] for t in trainers)
                          for phase in reference_hybrid.PHASES})


def spread(values: Sequence[float]) -> Dict[str, float]:
    """min, median and max of ``values``, and the spread: how far the farthest is from the median, in % of it."""
    middle = statistics.median(values)
    return {"min": min(values), "median": middle, "max": max(values),
            "spread_pct": 100.0 * max(abs(value - middle) for value in values) / middle if middle else float("inf")}


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("inf")


def verdict(name: str, value: float, target: float) -> str:
    return f"{name} = {value:.2f}x (target >= {target:.1f}x) {'PASS' if value >= target else 'BELOW'}"


def report(runs: Dict[str, List[Dict]], args, load_before: float) -> None:
    spreads = {name: spread([r["samples_per_s"] for r in results]) for name, results in runs.items()}
    median = {name: figures["median"] for name, figures in spreads.items()}
    reference = median[REFERENCE]
    threads = threads_of(args)
    staleness = "" if args.staleness is None else f", ours with staleness {args.staleness}"
    if args.cache_rows is not None:
        staleness += f", row cache of {args.cache_rows:,} rows" + \
            ("" if args.cache_steps is None else f" over {args.cache_steps} steps")
    if args.sparse_optimizer is not None:
        staleness += f", ours' tables stepped by {args.sparse_optimizer} (the others' by qhm)"
    print(f"# End-to-end training throughput: torch {torch.__version__}, {os.cpu_count()} cores, "
          f"{args.steps} steps x batch {args.batch} per trainer, timed from step {args.warmup} (ours: from step "
          f"{window_steps(args)[0]}, the first it logs), {reference_hybrid.TRAINERS} trainers, "
          f"{reference_hybrid.NUM_PS} parameter servers, {args.repeats} round(s), the contestants interleaved in each"
          f"{staleness}; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    if args.threads:
        print(f"# intra-op threads (--threads): {args.threads} in every process of every contestant\n")
    else:
        print(f"# intra-op threads: floor {threads[FLOOR]['floor']}; paramserver "
              f"{', '.join(f'{kind} {n}' for kind, n in threads[OURS].items())} (as ps-demo sizes them); reference "
              f"{', '.join(f'{kind} {n}' for kind, n in threads[REFERENCE].items())}\n")
    print("| implementation | samples/s (median) | min | max | spread | vs reference | vs floor | ms/step | final loss "
          "| runs in order (samples/s; with the warm-up) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, results in runs.items():
        figures = spreads[name]
        per_step_ms = 1e3 * reference_hybrid.TRAINERS * args.batch / median[name]
        loss = statistics.mean(r["loss"] for r in results)
        every = ", ".join(f"{r['samples_per_s']:,.0f}" + (f" ({r['samples_per_s_with_warmup']:,.0f})"
                                                          if "samples_per_s_with_warmup" in r else "")
                          for r in results)
        print(f"| {LABELS[name]} | {median[name]:,.0f} | {figures['min']:,.0f} | {figures['max']:,.0f} "
              f"| {figures['spread_pct']:.1f}% | {ratio(median[name], reference):.2f}x "
              f"| {ratio(median[name], median[FLOOR]):.2f}x | {per_step_ms:.1f} | {loss:.4f} | {every} |")
    print("\nspread: how far the run farthest from a contestant's median is from it, in % of the median; the ratios "
          "and the verdicts below are of the medians")
    report_cpu(runs)
    references = [name for name in (REFERENCE, DENSE) if name in runs]
    print("\n| where a reference step's time goes (trainer mean, ms) | "
          + " | ".join(f"{'sparse=True' if n == REFERENCE else 'dense gradient'}" for n in references) + " |")
    print("|---|" + "---:|" * len(references))
    for phase in reference_hybrid.PHASES:
        cells = " | ".join(f"{statistics.mean(r['phase_ms'][phase] for r in runs[n]):.1f}" for n in references)
        print(f"| {phase} | {cells} |")
    if runs[OURS][0]["phase_ms"]:
        print("\n| where a paramserver step's time goes (worker mean, ms) | |\n|---|---:|")
        for phase, label in PHASES.items():
            print(f"| {label} | {statistics.mean(r['phase_ms'].get(phase, 0.0) for r in runs[OURS]):.1f} |")
        print(f"| of the backward: its all-reduce in flight | "
              f"{statistics.mean(r['allreduce_ms'] for r in runs[OURS]):.1f} |")
    print("\n| where a floor step's time goes (ms) | |\n|---|---:|")
    for phase in local_floor.PHASES:
        print(f"| {phase} | {statistics.mean(r['phase_ms'][phase] for r in runs[FLOOR]):.1f} |")
    if args.cache_rows is not None:
        print("\n| the workers' row cache (the workers' mean, mean of the runs) | |\n|---|---:|")
        for name in ("hit_rate", "rows_read", "hits", "bytes_saved", "evictions", "windows"):
            value = statistics.mean(r["row_cache"].get(name, 0.0) for r in runs[OURS])
            print(f"| {name} | {value:.3f} |" if name == "hit_rate" else f"| {name} | {value:,.0f} |")
    growth = statistics.mean(r.get("rss_growth_mib", {}).get("worker", 0.0) for r in runs[OURS])
    print(f"\npeak growth of a worker's resident memory over training (ours, the larger of the two, mean of the "
          f"runs): {growth:.1f} MiB")
    stale = bool(args.staleness)
    print()
    worst = max(spreads, key=lambda name: spreads[name]["spread_pct"])
    print(f"end-to-end: spread across {args.repeats} runs within {SPREAD_TARGET_PCT:.0f}% of the median "
          f"(the widest: {LABELS[worst]}, {spreads[worst]['spread_pct']:.1f}%; "
          + ", ".join(f"{name} {figures['spread_pct']:.1f}%" for name, figures in spreads.items())
          + f") {'PASS' if spreads[worst]['spread_pct'] <= SPREAD_TARGET_PCT else 'BELOW'}")
    print("end-to-end: " + verdict("paramserver / floor (one process)", ratio(median[OURS], median[FLOOR]),
                                   FLOOR_TARGET_STALE if stale else FLOOR_TARGET)
          + f" [{'with staleness' if stale else 'staleness 0'}]")
    print("end-to-end: " + verdict("paramserver / torch RPC+DDP reference", ratio(median[OURS], reference),
                                   REFERENCE_TARGET))


def report_cpu(runs: Dict[str, List[Dict]]) -> None:
    """CPU seconds per 1,000 samples by kind of process (means over repeats): where a sample's cost goes."""
    def cell(name: str, kind: Optional[str]) -> str:
        if kind is None or name not in runs:
            return ""
        return f"{statistics.median(r['cpu_per_1000'].get(kind, 0.0) for r in runs[name]):.4f}"

    def total(name: str, kinds: Sequence[Optional[str]]) -> str:
        totals = [sum(r['cpu_per_1000'].get(k, 0.0) for k in kinds if k) for r in runs[name]]
        return f"{statistics.median(totals):.4f} ({min(totals):.4f}-{max(totals):.4f})"

    windowed = all(r["cpu_window"] for results in runs.values() for r in results)
    window = "timed window only" if windowed else "start-up or exit included in some"
    print(f"\n| CPU seconds per 1,000 samples, medians of the runs ({window}) "
          f"| paramserver | reference | floor |\n|---|---:|---:|---:|")
    for label, ours, theirs in CPU_ROWS:
        floor = cell(FLOOR, "floor") if ours == "worker" else ""  # the floor's one process trains
        print(f"| {label} | {cell(OURS, ours)} | {cell(REFERENCE, theirs)} | {floor} |")
    print(f"| total (min-max) | {total(OURS, [row[1] for row in CPU_ROWS])} "
          f"| {total(REFERENCE, [row[2] for row in CPU_ROWS])} | {total(FLOOR, ['floor'])} |")
    ours = statistics.median(sum(r["cpu_per_1000"].get(row[1], 0.0) for row in CPU_ROWS) for r in runs[OURS])
    floor = statistics.median(r["cpu_per_1000"]["floor"] for r in runs[FLOOR])
    print(f"\nCPU per sample, paramserver / floor (medians): {ratio(ours, floor):.2f}x")
    groups = sorted({group for r in runs[OURS] for group in r.get("thread_cpu_per_1000", {})})
    shown = {group: statistics.median(r.get("thread_cpu_per_1000", {}).get(group, 0.0) for r in runs[OURS])
             for group in groups}
    shown = {group: value for group, value in shown.items() if value >= THREAD_ROW_AT_LEAST}
    if shown:
        print("\n| paramserver's CPU seconds per 1,000 samples by thread (kind of process / its threads, medians; "
              "main: the process's first thread; python: its other Python threads, a worker's batch reader among them; "
              "benchmark: this script's watcher) | |\n|---|---:|")
        for group, value in sorted(shown.items(), key=lambda item: -item[1]):
            print(f"| {group} | {value:.4f} |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="The default job's samples/s: paramserver vs torch RPC+DDP "
                                                 "vs the same model in one process.")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"training steps per trainer (default {DEFAULT_STEPS})")
    parser.add_argument("--warmup", type=int, default=None, metavar="N",
                        help=f"steps of each run trained before its timed window starts (default {DEFAULT_WARMUP}, "
                             "a sixth of --steps when that is fewer; ours' window starts at the first step its "
                             "workers log at or after it)")
    parser.add_argument("--batch", type=int, default=1024, help="samples per trainer per step (default 1024)")
    parser.add_argument("--repeats", "--rounds", dest="repeats", type=int, default=DEFAULT_ROUNDS,
                        help=f"rounds: runs of each contestant, interleaved (default {DEFAULT_ROUNDS})")
    parser.add_argument("--log-every", type=int, default=50,
                        help="the job's log_every; also the window of the final loss (default 50)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="intra-op threads of every process of every contestant (default: the floor every "
                             "core, each distributed process its share; see the module's docstring)")
    parser.add_argument("--staleness", type=int, default=None, metavar="K",
                        help='ours only: the job configuration\'s "staleness": K (default: not set, the job\'s own)')
    parser.add_argument("--cache-rows", type=int, default=None, metavar="N",
                        help='ours only: the job configuration\'s "cache_rows": N (the workers\' row cache)')
    parser.add_argument("--cache-steps", type=int, default=None, metavar="L",
                        help='ours only, with --cache-rows: "cache_steps": L (default: the Trainer\'s, which '
                             'follows the host)')
    parser.add_argument("--sparse-optimizer", default=None, metavar="NAME", choices=list(SPARSE_OPTIMIZERS),
                        help='ours only: the job configuration\'s "sparse_optimizer": NAME, one of '
                             f'{", ".join(SPARSE_OPTIMIZERS)} (default: not set, the job\'s own, qhm); the floor '
                             'and the reference still run qhm')
    parser.add_argument("--no-dense-variant", action="store_true",
                        help="skip the tutorial's dense-gradient EmbeddingBag variant")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on one contestant's run after this long (default 600)")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.repeats, args.log_every, args.threads or 1) < 1:
        parser.error("--steps, --batch, --repeats, --log-every and --threads must be at least 1")
    if args.warmup is None:
        args.warmup = min(DEFAULT_WARMUP, args.steps // 6)
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and under --steps")
    if args.staleness is not None and args.staleness < 0:
        parser.error("--staleness must be at least 0")
    if (args.cache_rows is not None and args.cache_rows < 1) or \
            (args.cache_steps is not None and (args.cache_rows is None or args.cache_steps < 1)):
        parser.error("--cache-rows must be at least 1, and --cache-steps (at least 1) needs --cache-rows")
    contestants = [OURS, FLOOR, REFERENCE] + ([] if args.no_dense_variant else [DENSE])
    runs: Dict[str, List[Dict]] = {name: [] for name in contestants}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="end_to_end-") as folder:
        try:
            for repeat in range(args.repeats):
                for name in (contestants if repeat % 2 == 0 else contestants[::-1]):
                    progress(f"round {repeat + 1}/{args.repeats}: {LABELS[name]}, {args.steps} steps")
                    run_folder = pathlib.Path(folder) / f"{name}-{repeat}"
                    run_folder.mkdir()
                    if name == OURS:
                        result = run_ours(args, run_folder)
                    elif name == FLOOR:
                        result = run_floor(args, run_folder)
                    else:
                        result = run_reference(args, run_folder, sparse=name == REFERENCE)
                    progress(f"  {result['samples_per_s']:,.0f} samples/s from step {args.warmup}, "
                             f"loss {result['loss']:.4f}")
                    runs[name].append(result)
        except ContestantFailed as error:
            progress(str(error))
            return 1
    report(runs, args, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
