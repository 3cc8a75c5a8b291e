"""What does keeping a dynamic table's rows on disk cost the CTR job?  Samples/s against the same job in memory.

What it measures
    The default CTR job (``paramserver.jobs.ctr``) on dynamic tables, through the real commands on this
    machine: ``ps-server --shards 2`` (its shards' row store under a temporary folder on local disk,
    ``--row-store``) and one ``ps-worker``, stopped with ``ps-ctl shutdown``.  Samples/s is the worker's steps
    x batch over a window of the run (from this process's polls of the coordinator's status: the start-up, the
    first quarter of the steps, the held-out evaluation and the exit left out).  Each run reads, at every poll
    (``--poll``, 0.5 s), the shards' heartbeat figures (``dynamic.*``, summed over a shard's tables), their
    resident memory (``VmRSS`` of each shard's process, by the pid the status gives) and the bytes of the row
    store's files.  Cases:

    1. **20% in memory** (``--case memory``): ids drawn from a Zipf law of exponent ``--zipf`` (1.05: far
       heavier tail than the demo's 1.4) over vocabularies of ``--vocab`` (2M, 1M, 200k, ...), ``--steps``
       (1500) steps of 1024 samples.  (a) every row in memory (no capacity), against (b) a ``capacity`` that
       leaves ``--in-memory`` (20%) of the rows held in memory: the rows (a) held at its end, per table and
       shard (the shards' Prometheus metrics, ``--metrics-port``), give the one capacity ``C`` (the job's
       ``table_options`` apply to every table) with ``sum(min(rows, C))`` = 20% of them; the small tables
       stay whole.  Runs alternate a, b, b, a, ... (``--rounds`` each, 2).  Target: (b) at least 0.8x (a).
    2. **a billion-id table** (``--case billion``): the first feature's ids drawn over 1,000,000,000 ids
       (``--big-vocab``; the planted data draws such a feature by hashing its Zipf ranks:
       ``CTRSpec.tabulated_up_to``), 16-dim float16 rows with row-wise Adagrad, every table's rows sharing
       ``--row-memory`` (64 MiB) per shard, trained for ``--seconds`` (120) after ``--warm-steps``; against
       the same job with the feature's ids drawn over 20,000,000 (``--reference-vocab``) and every row in
       memory, in the same run.  Target: at least 0.5x.  At the end of the first billion run's window,
       ``ps-ctl checkpoint`` (the run has ``--checkpoint-dir`` beside the row store and ``--push-log off``):
       its time, bytes and rows (counted in its files), each shard's resident memory while it runs (read every
       0.05 s, and ``VmHWM`` reset as it begins); then ``ps-server --shards 3 --restore`` it (``--restore-shards``)
       with the same job, row store and budget, and one worker, until it trained 5 steps past the checkpoint's:
       the time from its start, the rows the shards restored (their logs, and their figures: in memory + on
       disk - admitted since) against the checkpoint's, each shard's peak resident memory (``VmHWM``).

    The hit rate is the training lookups' ids found in memory over all of them (found, read back from the
    store, or new); rows and bytes read and written per step are the shards' counters' growth over the window,
    over the steps in it.  Where the shards report no row store counters (``dynamic.memory_hits``,
    ``store_reads``, ``store_writes``, ``store_read_bytes``, ``store_written_bytes``, ``rows_on_disk``), the
    rows are derived from those they do report (marked ``*``: rows written = rows evicted, ...; exact with no
    TTL and every id admitted, as here) and the bytes print as ``n/a``.

How to run
    ``.venv/bin/python benchmarks/row_store.py [--case memory|billion|both] [--steps 1500] [--rounds 2]
    [--seconds 120] [--row-memory 64MiB] [--zipf 1.05] [--engine log|rocksdb] [--staleness 0]``: about 10 minutes for
    both on 2 cores.  ``--quick``: 300 steps, one round, 30 seconds (a smoke run).  Progress on stderr,
    results on stdout as markdown; every run's command on stderr.

How to read it
    Figures are medians over a contestant's runs; ratios are ratios of medians.  A target line says met or
    NOT met; the script exits 0 either way.  The machine is shared and noisy: compare runs, not digits.
    After each run with a row store, the folder is checked: a shard removes its files when it stops, so
    anything left is reported.
"""

import argparse
import itertools
import json
import os
import pathlib
import shlex
import shutil
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from paramserver.checkpoint.shard_part import PART_PREFIX
from paramserver.checkpoint.storage import load_tensors
from paramserver.cli.demo import LocalProcesses, wait_for_ready
from paramserver.cli.server import size_from
from paramserver.control import CoordinatorClient, CoordinatorError
from paramserver.jobs.ctr_data import CTRSpec, PlantedCTR
from paramserver.shards.server.row_store.stores import ROW_OVERHEAD_BYTES, STATE_BYTES_PER_VALUE
from paramserver.runtime.job import DEFAULT_JOB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder's helpers
from process_cpu import read_rss  # noqa: E402

SHARDS = 2
BATCH = 1024
STOPS_WITHIN = 60.0
RUN_WITHIN = 900.0
#: ``ps-ctl checkpoint --timeout`` of the billion case's checkpoint.
CHECKPOINT_WITHIN = 1800.0
#: Seconds between reads of the shards' resident memory while a checkpoint or a restore runs.
FAST_POLL = 0.05
#: Steps the worker of the cluster restored from the checkpoint trains past the checkpoint's step.
RESTORE_STEPS = 5
#: A shard's resident memory rising this little during a checkpoint or a restore is taken as noise.
NOISE_BYTES = 16 * 2 ** 20
#: What one of the billion case's rows counts against ``--row-memory``: 16 float16 values, room for 16 x 8
#: bytes of optimizer state, 40 bytes of index (``row_store.stores.row_bytes``).
ROW_BYTES = 16 * 2 + 16 * STATE_BYTES_PER_VALUE + ROW_OVERHEAD_BYTES
TARGET_MEMORY = 0.8
TARGET_BILLION = 0.5
#: A figure derived from others (``Run.rows_read`` ...), not reported by the shards.
DERIVED = "*"
DEFAULT_VOCAB = (2_000_000, 1_000_000, 200_000, 50_000, 10_000, 1_000, 100, 20)
SMALL_VOCAB = (20_000, 10_000, 5_000, 1_000, 500, 100, 20)  # the billion case's other features (the demo's)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on loopback now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as taken:
                    taken.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found")


def reset_peak(pid: int) -> bool:
    """Start a process's ``VmHWM`` again from its resident memory now (Linux's ``clear_refs`` 5); whether it
    could."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def folder_bytes(folder: Optional[pathlib.Path]) -> int:
    total = 0
    if folder is None:
        return 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile (a compaction)
                pass
    return total


def part_rows(metrics_port: int) -> Dict[str, List[int]]:
    """The rows each dynamic table part holds, by table: the shards' Prometheus metrics."""
    rows: Dict[str, List[int]] = {}
    for shard in range(SHARDS):
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port + 1 + shard}/metrics", timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith("paramserver_dynamic_rows{"):
                    labels, value = line[len("paramserver_dynamic_rows{"):].rsplit("} ", 1)
                    table = dict(item.split("=", 1) for item in labels.split(","))["table"].strip('"')
                    rows.setdefault(table, []).append(int(float(value)))
    return rows


def capacity_for(rows: Dict[str, List[int]], share: float) -> int:
    """The capacity ``C`` (rows per table part) with ``sum(min(rows, C))`` closest to ``share`` of all rows."""
    counts = [count for parts in rows.values() for count in parts]
    wanted = share * sum(counts)
    low, high = 1, max(counts)
    while low < high:
        middle = (low + high) // 2
        if sum(min(count, middle) for count in counts) < wanted:
            low = middle + 1
        else:
            high = middle
    return low


@dataclass
class Poll:
    at: float
    step: int
    figures: Dict[str, float]  # the shards' dynamic.* figures, summed over shards
    rss: int  # the shards' resident memory, summed
    disk: int  # bytes of the row store's files


@dataclass
class Run:
    """One run's figures over its window (steps ``first_step`` to ``last_step``)."""

    name: str
    samples_per_s: float
    first_step: int
    last_step: int
    peak_rss: int
    end_rss: int
    peak_disk: int
    end_disk: int
    start: Dict[str, float]  # the shards' figures at the window's start
    end: Dict[str, float]  # and at its end
    store: bool = False
    rows: Dict[str, List[int]] = field(default_factory=dict)
    files_left: List[str] = field(default_factory=list)
    #: The ids the window's training lookups asked for (each step's distinct ids per table), from the data.
    looked_up: Optional[int] = None
    #: What ``run_job``'s ``after_window`` returned (the billion case: its checkpoint, ``CheckpointRun``).
    after: object = None

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step

    def growth(self, key: str) -> Optional[float]:
        return self.end[key] - self.start.get(key, 0.0) if key in self.end else None

    def per_step(self, key: str) -> Optional[float]:
        growth = self.growth(key)
        return None if growth is None else growth / self.steps

    # Where the shards report no row store counters, derived from the figures they do report (marked
    # ``DERIVED``): with no TTL and every id admitted, a row evicted for capacity is written to the store, and
    # every row ever admitted is in memory or on disk.
    def rows_written(self) -> Tuple[Optional[float], bool]:
        if "store_writes" in self.end:
            return self.growth("store_writes"), False
        return (self.growth("evicted") if self.store else 0.0), True

    def rows_read(self) -> Tuple[Optional[float], bool]:
        if "store_reads" in self.end:
            return self.growth("store_reads"), False
        if not self.store:
            return 0.0, True
        written, admitted, held = self.growth("evicted"), self.growth("admitted"), self.growth("rows")
        return (None if None in (written, admitted, held) else written - (admitted - held)), True

    def rows_on_disk(self) -> Tuple[Optional[float], bool]:
        if "rows_on_disk" in self.end:
            return self.end["rows_on_disk"], False
        if not self.store:
            return 0.0, True
        return (self.end["admitted"] - self.end["rows"] if "admitted" in self.end else None), True

    def hit_rate(self) -> Tuple[Optional[float], bool]:
        new = self.growth("admitted") or 0.0
        if "memory_hits" in self.end and "store_reads" in self.end:
            hits = self.growth("memory_hits")
            looked_up = hits + self.growth("store_reads") + new
            return (hits / looked_up if looked_up else None), False
        read, _ = self.rows_read()
        if read is None or not self.looked_up:
            return None, True
        return (self.looked_up - read - new) / self.looked_up, True


class Cluster:
    """``ps-server --shards 2`` (``shards``; flags ``server_flags``) and one ``ps-worker`` training ``config``,
    started as ps-demo starts them, logging under ``folder``; ``stop()`` shuts it down with ``ps-ctl shutdown``."""

    def __init__(self, folder: pathlib.Path, config: Dict, server_flags: Sequence[str], shards: int = SHARDS):
        self.processes = LocalProcesses(folder)
        host_processes = 2 + shards
        args = ["--shards", str(shards), "--port", "0", "--group-size", "1", "--job", DEFAULT_JOB,
                "--job-config", json.dumps(config), *server_flags]
        progress(f"  ps-server {shlex.join(args)}")
        server = self.processes.start("ps-server", "paramserver.cli.server", *args, host_processes=host_processes)
        self.address = wait_for_ready(self.processes, server)
        self.worker = self.processes.start("ps-worker0", "paramserver.cli.worker", "--connect", self.address,
                                           host_processes=host_processes)
        self.client = CoordinatorClient(self.address)

    def check(self) -> None:
        for name, process in self.processes.started.items():
            if process.poll() is not None and (name != "ps-worker0" or process.returncode != 0):
                raise self.processes.failure(name, f"exited with {process.returncode}")

    def poll(self, store: Optional[pathlib.Path]) -> Optional[Poll]:
        try:
            status = self.client.status()
        except CoordinatorError:
            return None
        figures: Dict[str, float] = {}
        rss = 0
        for shard in status.shards:
            for key, value in shard.metrics.items():
                if key.startswith("dynamic."):
                    figures[key[len("dynamic."):]] = figures.get(key[len("dynamic."):], 0.0) + value
            rss += read_rss(shard.pid) if shard.pid else 0
        step = max((worker.step for worker in status.workers), default=0)
        return Poll(time.monotonic(), step, figures, rss, folder_bytes(store))

    def shards(self) -> List[Tuple[int, Dict[str, float]]]:
        """Each shard's pid and heartbeat figures (``dynamic.*``, without the prefix), from the status now."""
        return [(shard.pid, {key[len("dynamic."):]: value for key, value in shard.metrics.items()
                             if key.startswith("dynamic.")}) for shard in self.client.status().shards]

    def stop(self) -> None:
        self.client.close()
        self.processes.shut_down(self.address, STOPS_WITHIN)


def window_run(name: str, polls: List[Poll], first: int, last: int) -> Run:
    """``name``'s figures over the polls from the first at step ``first`` or later to the last at ``last`` or
    earlier."""
    inside = [poll for poll in polls if first <= poll.step <= last]
    if len(inside) < 2 or inside[-1].step == inside[0].step:
        raise RuntimeError(f"{name}: too few polls between steps {first} and {last} (steps seen: "
                           f"{[poll.step for poll in polls][-10:]})")
    start, end = inside[0], inside[-1]
    return Run(name, (end.step - start.step) * BATCH / (end.at - start.at), start.step, end.step,
               max(poll.rss for poll in polls), end.rss, max(poll.disk for poll in polls), end.disk,
               dict(start.figures), dict(end.figures))


def distinct_ids_looked_up(spec: Dict, first: int, last: int, sampled: int = 200) -> int:
    """The ids the training lookups of steps ``first`` to ``last`` asked for: each batch's distinct ids per
    table (worker 0's stream of the job's planted data, seed 0; a shard's part of a table gets its share),
    counted on ``sampled`` of the steps spread over them (a batch's count hardly varies) and scaled."""
    data = PlantedCTR(CTRSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}), seed=0)
    steps = range(first + 1, last + 1)
    picked = steps[::max(1, len(steps) // sampled)]
    counted = sum(ids.unique().numel() for index in picked for ids in data.batch(0, index, BATCH).ids)
    return round(counted * len(steps) / len(picked))


def run_job(name: str, scratch: pathlib.Path, config: Dict, server_flags: Sequence[str],
            store: Optional[pathlib.Path], first: int, last: Optional[int], seconds: Optional[float],
            poll_every: float, metrics_port: Optional[int] = None,
            after_window: Optional[Callable[["Cluster"], object]] = None) -> Run:
    """One cluster trains ``config``: to its end (``last`` is its last step measured) or, with ``seconds``, for
    that long after step ``first``; its figures over the window.  ``after_window(cluster)`` runs after the
    window, before the cluster stops (what it returns is the run's ``after``)."""
    logs = pathlib.Path(tempfile.mkdtemp(prefix=f"{name.replace(' ', '_')}-", dir=scratch))
    cluster = Cluster(logs, config, server_flags)
    polls: List[Poll] = []
    rows: Dict[str, List[int]] = {}
    began = time.monotonic()
    try:
        measuring_since = None
        while cluster.worker.poll() is None:
            cluster.check()
            if time.monotonic() - began > RUN_WITHIN:
                raise RuntimeError(f"{name}: did not finish within {RUN_WITHIN:.0f} s")
            poll = cluster.poll(store)
            if poll is not None:
                polls.append(poll)
                if seconds is not None and poll.step >= first:
                    measuring_since = measuring_since or poll.at
                    if poll.at - measuring_since >= seconds:
                        break
            time.sleep(poll_every)
        cluster.check()
        if metrics_port is not None:
            rows = part_rows(metrics_port)
        after = after_window(cluster) if after_window is not None else None
    finally:
        cluster.stop()
    result = window_run(name, polls, first, last if last is not None else polls[-1].step)
    result.rows, result.store, result.after = rows, store is not None, after
    result.looked_up = distinct_ids_looked_up(config["spec"], result.first_step, result.last_step)
    if store is not None:
        result.files_left = [str(path) for path in store.rglob("*")]
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir()
    progress(f"  {name}: {result.samples_per_s:,.0f} samples/s over {result.steps} steps; shards' RSS peak "
             f"{result.peak_rss / 2 ** 20:,.0f} MiB; row store's files peak {result.peak_disk / 2 ** 20:,.1f} MiB"
             + (f"; FILES LEFT: {result.files_left[:5]}" if result.files_left else ""))
    return result


# --------------------------------------------------------------------------
# The billion case's checkpoint, and its restore onto another shard count
# --------------------------------------------------------------------------

@dataclass
class CheckpointRun:
    """``ps-ctl checkpoint`` at the end of a run's window: its time, what it wrote, the shards' memory (each
    shard's, in the status's order)."""

    seconds: float
    step: int
    directory: pathlib.Path
    bytes: int
    rows: int  # the dynamic tables' rows in its files
    rows_reported: float  # the shards' dynamic.rows + dynamic.rows_on_disk, from the status after it
    rss_before: List[int]  # as it was asked for
    peak_rss: List[int]  # the most read while it ran (every FAST_POLL), or VmHWM where it could be reset

    @property
    def rise(self) -> int:
        return max(peak - before for peak, before in zip(self.peak_rss, self.rss_before))


@dataclass
class RestoreRun:
    """A cluster of ``shards`` shards started from a checkpoint (``ps-server --restore``): its times from its
    start, the rows its shards restored, their memory (each shard's)."""

    shards: int
    ready_seconds: float  # until ps-server said it was ready
    trained_seconds: float  # until the worker reported a step past the checkpoint's
    rows_read: int  # the rows the shards' logs say they read from the checkpoint
    rows_reported: float  # the shards' dynamic.rows + rows_on_disk - admitted (no TTL: the rows restored)
    rows_in_memory: float
    rows_on_disk: float
    #: Each shard's resident memory when the status first showed it with no table made (``None``: it had one).
    start_rss: List[Optional[int]]
    peak_rss: List[int]  # VmHWM: the most each shard held in its life, the restore included
    end_rss: List[int]  # RESTORE_STEPS steps past the checkpoint's
    held: List[float]  # each shard's rows in memory then (``dynamic.rows``)

    @property
    def rise(self) -> int:
        return max(peak - end for peak, end in zip(self.peak_rss, self.end_rss))

    def excess(self) -> Optional[int]:
        """The most a shard's peak passed its memory before its tables were made plus what its rows in memory
        count against ``--row-memory`` (``ROW_BYTES`` each); ``None`` where a start was not seen."""
        if None in self.start_rss:
            return None
        return max(peak - start - round(held * ROW_BYTES)
                   for peak, start, held in zip(self.peak_rss, self.start_rss, self.held))


def checkpoint_rows(directory: pathlib.Path) -> int:
    """The rows of the dynamic tables in the shards' parts of the checkpoint in ``directory`` (memory-mapped)."""
    rows = 0
    for part in sorted(directory.glob(f"{PART_PREFIX}*.pt")):
        entries = load_tensors(part, mmap=True)["tables"].values()
        rows += sum(entry["ids"].numel() for entry in entries if isinstance(entry, dict) and entry.get("dynamic"))
    return rows


def take_checkpoint(cluster: Cluster, root: pathlib.Path) -> CheckpointRun:
    """``ps-ctl checkpoint`` on ``cluster`` (its ``--checkpoint-dir``: ``root``), timed, with the shards' resident
    memory read every ``FAST_POLL`` while it runs (and their ``VmHWM``, reset as it starts, where Linux lets)."""
    pids = [pid for pid, _ in cluster.shards()]
    before = [read_rss(pid) for pid in pids]
    reset = all([reset_peak(pid) for pid in pids])
    command = [sys.executable, "-m", "paramserver.cli.ctl", "--connect", cluster.address, "checkpoint",
               "--timeout", f"{CHECKPOINT_WITHIN:.0f}"]
    progress(f"  ps-ctl {shlex.join(command[3:])}")
    began = time.monotonic()
    ctl = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = list(before)
    try:
        while ctl.poll() is None:
            peaks = [max(peak, read_rss(pid)) for peak, pid in zip(peaks, pids)]
            cluster.check()
            if time.monotonic() - began > CHECKPOINT_WITHIN + 30:
                raise RuntimeError(f"ps-ctl checkpoint gave no answer within {CHECKPOINT_WITHIN + 30:.0f} s")
            time.sleep(FAST_POLL)
        seconds = time.monotonic() - began
    finally:
        if ctl.poll() is None:
            ctl.kill()
        out, err = ctl.communicate(timeout=STOPS_WITHIN)
    done = re.search(r"checkpoint (ckpt-\d+) written at step (\d+)", out)
    if ctl.returncode != 0 or done is None:
        raise RuntimeError(f"ps-ctl checkpoint exited with {ctl.returncode}: {(out + err).strip()}")
    if reset:
        peaks = [max(peak, read_rss(pid, "VmHWM")) for peak, pid in zip(peaks, pids)]
    directory = root / done.group(1)
    reported = sum(figures.get("rows", 0.0) + figures.get("rows_on_disk", 0.0) for _, figures in cluster.shards())
    result = CheckpointRun(seconds, int(done.group(2)), directory, folder_bytes(directory), checkpoint_rows(directory),
                           reported, before, peaks)
    progress(f"  {done.group(1)}: {result.rows:,} rows, {result.bytes / 2 ** 20:,.1f} MiB in {seconds:.1f} s; "
             f"shards' resident memory {mib_list(before)} before, {mib_list(peaks)} at most while it ran")
    return result


def restore_checkpoint(args, scratch: pathlib.Path, config: Dict, checkpoint: CheckpointRun,
                       store: pathlib.Path) -> RestoreRun:
    """``ps-server --shards args.restore_shards --restore`` ``checkpoint`` with the billion case's row store and
    budget, and one worker: timed from its start until the worker trains past the checkpoint's step, then
    ``RESTORE_STEPS`` steps more; the rows restored and the shards' memory."""
    logs = pathlib.Path(tempfile.mkdtemp(prefix="restore-", dir=scratch))
    flags = ["--restore", str(checkpoint.directory), "--row-store", str(store), "--row-store-engine", args.engine,
             "--row-memory", str(args.row_memory), "--push-log", "off"]
    began = time.monotonic()
    cluster = Cluster(logs, config, flags, shards=args.restore_shards)
    ready = time.monotonic() - began
    starts: Dict[int, Optional[int]] = {}  # by pid: the shard's resident memory before its tables were made
    try:
        trained = None
        while True:
            cluster.check()
            if time.monotonic() - began > RUN_WITHIN:
                raise RuntimeError(f"restore: the worker did not train past step {checkpoint.step} within "
                                   f"{RUN_WITHIN:.0f} s")
            try:
                status = cluster.client.status()
            except CoordinatorError:
                status = None
            for shard in status.shards if status is not None else ():
                if shard.pid and shard.pid not in starts:
                    made = any(key.startswith("dynamic.") for key in shard.metrics)
                    starts[shard.pid] = None if made else read_rss(shard.pid)
            step = max((worker.step for worker in status.workers), default=0) if status is not None else 0
            if trained is None and step > checkpoint.step:
                trained = time.monotonic() - began
            if step >= checkpoint.step + RESTORE_STEPS:
                break
            time.sleep(FAST_POLL)
        shards = cluster.shards()
        peaks = [read_rss(pid, "VmHWM") for pid, _ in shards]
        ends = [read_rss(pid) for pid, _ in shards]
    finally:
        cluster.stop()
    total = {key: sum(figures.get(key, 0.0) for _, figures in shards) for key in ("rows", "rows_on_disk", "admitted")}
    read = sum(int(found) for path in logs.glob("*.log")
               for found in re.findall(r"read from checkpoint step \d+: (\d+) rows", path.read_text(errors="replace")))
    result = RestoreRun(len(shards), ready, trained, read, total["rows"] + total["rows_on_disk"] - total["admitted"],
                        total["rows"], total["rows_on_disk"], [starts.get(pid) for pid, _ in shards], peaks, ends,
                        [figures.get("rows", 0.0) for _, figures in shards])
    progress(f"  restored onto {len(shards)} shards: {read:,} rows read, worker past step {checkpoint.step} "
             f"{trained:.1f} s after ps-server started; shards' resident memory {mib_list(result.start_rss)} before "
             f"their tables, {mib_list(peaks)} at most, {mib_list(ends)} after")
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir()
    return result


def mib_list(sizes: Sequence[Optional[int]]) -> str:
    return " / ".join("n/a" if size is None else f"{size / 2 ** 20:,.0f}" for size in sizes) + " MiB"


# --------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------

def job_config(args, steps: int, spec: Dict, **more) -> Dict:
    return {"dynamic_tables": True, "steps": steps, "hook": "allreduce", "eval_every": 10 ** 9,
            "log_every": 10 ** 9, "holdout_size": 4096, "spec": spec, "staleness": args.staleness, **more}


def memory_case(args, scratch: pathlib.Path) -> Dict:
    spec = {"zipf_exponent": args.zipf, "vocab_sizes": list(args.vocab)}
    store = scratch / "rows"
    store.mkdir()
    first, last = args.steps // 4, args.steps - 5
    metrics_port = free_ports(1 + SHARDS)
    progress(f"20% in memory: (a) every row in memory, to measure the rows held ...")
    runs: Dict[str, List[Run]] = {"a": [], "b": []}
    runs["a"].append(run_job("a: in memory", scratch, job_config(args, args.steps, spec),
                             ["--metrics-port", str(metrics_port)], None, first, last, None, args.poll, metrics_port))
    held = runs["a"][0].rows
    capacity = capacity_for(held, args.in_memory)
    in_memory = sum(min(count, capacity) for parts in held.values() for count in parts)
    total = sum(count for parts in held.values() for count in parts)
    progress(f"  rows held at the end of (a): {total:,} ({', '.join(f'{t}: {sum(p):,}' for t, p in held.items())}); "
             f"capacity {capacity:,} per table part keeps {in_memory:,} ({in_memory / total:.1%}) in memory")
    b_config = job_config(args, args.steps, spec, table_options={"capacity": capacity})
    b_flags = ["--row-store", str(store), "--row-store-engine", args.engine]
    left = {"a": args.rounds - 1, "b": args.rounds}
    order = []  # after the first (a): b, b, a, a, b, b, ...: each follows either one alike
    for name in itertools.cycle("bbaa"):
        if not any(left.values()):
            break
        if left[name]:
            order.append(name)
            left[name] -= 1
    for name in order:
        if name == "a":
            runs["a"].append(run_job("a: in memory", scratch, job_config(args, args.steps, spec), [], None, first,
                                     last, None, args.poll))
        else:
            runs["b"].append(run_job("b: capacity + row store", scratch, b_config, b_flags, store, first, last, None,
                                     args.poll))
    return {"runs": runs, "capacity": capacity, "held": total, "in_memory": in_memory, "spec": spec,
            "b_config": b_config, "b_flags": b_flags}


def billion_case(args, scratch: pathlib.Path) -> Dict:
    store = scratch / "rows"
    store.mkdir(exist_ok=True)
    runs: Dict[str, List[Run]] = {"reference": [], "billion": []}
    configs = {}
    for name, vocab in (("reference", args.reference_vocab), ("billion", args.big_vocab)):
        spec = {"zipf_exponent": args.zipf, "vocab_sizes": [vocab, *SMALL_VOCAB], "bag_sizes": [1, 1, 1, 3, 1, 1, 1, 1],
                "tabulated_up_to": 1 << 20}
        configs[name] = job_config(args, 10 ** 9, spec, sparse_optimizer="rowwise_adagrad", row_dtype="float16")
    checkpoints = scratch / "ckpt"
    flags = {"reference": [], "billion": ["--row-store", str(store), "--row-store-engine", args.engine,
                                          "--row-memory", str(args.row_memory), "--checkpoint-dir", str(checkpoints),
                                          "--push-log", "off"]}
    progress(f"a billion-id table: {args.seconds:.0f} s each after {args.warm_steps} steps, "
             f"{args.billion_rounds} round(s); the first billion run's checkpoint restored onto "
             f"{args.restore_shards} shards ...")
    checkpoint = restore = None
    for round_index in range(args.billion_rounds):
        for name in (("reference", "billion") if round_index % 2 == 0 else ("billion", "reference")):
            after = (lambda cluster: take_checkpoint(cluster, checkpoints)) \
                if name == "billion" and checkpoint is None else None
            run = run_job(name, scratch, configs[name], flags[name], store if name == "billion" else None,
                          args.warm_steps, None, args.seconds, args.poll, after_window=after)
            runs[name].append(run)
            if after is not None:
                checkpoint = run.after
                restore = restore_checkpoint(args, scratch, configs[name], checkpoint, store)
                shutil.rmtree(checkpoints, ignore_errors=True)
    return {"runs": runs, "configs": configs, "flags": flags, "checkpoint": checkpoint, "restore": restore}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def median(runs: List[Run], value) -> Tuple[Optional[float], bool]:
    """The median of ``value(run)`` (a number, or ``(number, derived)``) over ``runs``, and whether it is derived."""
    values, derived = [], False
    for run in runs:
        found = value(run)
        if isinstance(found, tuple):
            found, derived = found[0], derived or found[1]
        if found is not None:
            values.append(found)
    return (statistics.median(values) if values else None), derived


def shown(value: Tuple[Optional[float], bool], form: str = "{:,.0f}") -> str:
    number, derived = value
    return "n/a" if number is None else form.format(number) + (DERIVED if derived else "")


def met(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "NOT met"


def per_step(figure):
    """``figure(run)`` (``(number, derived)``) over the steps of the run's window."""
    def value(run: Run) -> Tuple[Optional[float], bool]:
        number, derived = figure(run)
        return (None if number is None else number / run.steps), derived
    return value


def table(columns: Dict[str, List[Run]]) -> None:
    names = list(columns)
    print("| per run (median) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    lines = [
        ("samples/s", lambda r: r.samples_per_s, "{:,.0f}"),
        ("hit rate (training lookups' ids found in memory)", Run.hit_rate, "{:.1%}"),
        ("ids looked up per step (distinct per table)", lambda r: (r.looked_up or 0) / r.steps, "{:,.0f}"),
        ("new rows per step", lambda r: r.per_step("admitted"), "{:,.1f}"),
        ("rows read back from the store per step", per_step(Run.rows_read), "{:,.1f}"),
        ("rows written to the store per step", per_step(Run.rows_written), "{:,.1f}"),
        ("bytes read from the store per step", lambda r: r.per_step("store_read_bytes"), "{:,.0f}"),
        ("bytes written to the store per step", lambda r: r.per_step("store_written_bytes"), "{:,.0f}"),
        ("rows in memory at the window's end (shards' `dynamic.rows`)", lambda r: r.end.get("rows"), "{:,.0f}"),
        ("rows on disk at the window's end", Run.rows_on_disk, "{:,.0f}"),
        ("shards' resident memory, peak (MiB, both shards)", lambda r: r.peak_rss / 2 ** 20, "{:,.0f}"),
        ("shards' resident memory at the window's end (MiB)", lambda r: r.end_rss / 2 ** 20, "{:,.0f}"),
        ("row store's files, peak (MiB)", lambda r: r.peak_disk / 2 ** 20, "{:,.1f}"),
        ("row store's files at the window's end (MiB)", lambda r: r.end_disk / 2 ** 20, "{:,.1f}"),
        ("steps measured", lambda r: r.steps, "{:,.0f}"),
    ]
    for label, value, form in lines:
        print(f"| {label} | " + " | ".join(shown(median(columns[name], value), form) for name in names) + " |")
    print()
    print(f"Figures marked {DERIVED} are derived, where the shards report no row store counters: rows written = "
          "rows evicted (for capacity, into the store), rows on disk = rows admitted - rows in memory, rows read "
          "back = written - the growth of those on disk, hit rate = 1 - (read back + new) / the ids looked up (each "
          "step's distinct ids per table, from the planted data); exact with no TTL and every id admitted, the "
          "shards' figures read from their last heartbeat (at most a second old).")


def report_memory(args, found: Dict) -> None:
    runs = found["runs"]
    a, b = (median(runs[name], lambda r: r.samples_per_s)[0] for name in ("a", "b"))
    print(f"## 20% in memory: {SHARDS} shards, 1 worker, {args.steps} steps of {BATCH}, Zipf {args.zipf} over "
          f"vocabularies {', '.join(f'{v:,}' for v in args.vocab)}; {args.rounds} runs each, alternating")
    print()
    print(f"(a) every row in memory; (b) `table_options: {{capacity: {found['capacity']:,}}}` (per table part) and "
          f"`--row-store` ({args.engine}): {found['in_memory']:,} of the {found['held']:,} rows (a) held at its end "
          f"({found['in_memory'] / found['held']:.1%}) fit in memory. Window: steps {args.steps // 4} to "
          f"{args.steps - 5}.")
    print()
    table({"(a) in memory": runs["a"], "(b) capacity + row store": runs["b"]})
    print()
    print("Runs, samples/s: " + "; ".join(f"{name}: " + ", ".join(f"{r.samples_per_s:,.0f}" for r in runs[name])
                                          for name in ("a", "b")))
    print(f"* (b) / (a) samples/s: {b / a:.2f}x, target at least {TARGET_MEMORY}x: {met(b / a, TARGET_MEMORY)}")
    files_left(runs["b"])
    print(f"* (b)'s command: `ps-demo --shards {SHARDS} --workers 1 --steps {args.steps} --hook allreduce "
          f"--job-config '{json.dumps(found['b_config'])}' --server-flags \"{' '.join(found['b_flags'])}\"` "
          "(this benchmark starts ps-server and ps-worker as ps-demo does)")


def report_billion(args, found: Dict) -> None:
    runs = found["runs"]
    ref, big = (median(runs[name], lambda r: r.samples_per_s)[0] for name in ("reference", "billion"))
    print()
    print(f"## A billion-id table: {SHARDS} shards, 1 worker, batches of {BATCH}, 16-dim float16 rows, row-wise "
          f"Adagrad, Zipf {args.zipf}; {args.seconds:.0f} s measured after {args.warm_steps} steps, "
          f"{args.billion_rounds} run(s) each")
    print()
    print(f"The first feature's ids drawn over {args.big_vocab:,} ids with `--row-memory {args.row_memory}` per "
          f"shard and `--row-store` ({args.engine}), against the same job with them drawn over "
          f"{args.reference_vocab:,} ids, every row in memory.")
    print()
    table({f"{args.reference_vocab:,} ids, in memory": runs["reference"],
           f"{args.big_vocab:,} ids, row store": runs["billion"]})
    print()
    print(f"* billion / reference samples/s: {big / ref:.2f}x, target at least {TARGET_BILLION}x: "
          f"{met(big / ref, TARGET_BILLION)}")
    files_left(runs["billion"])
    print(f"* the billion run's job config: `{json.dumps(found['configs']['billion'])}`, ps-server flags "
          f"`{' '.join(found['flags']['billion'])}`")


def report_checkpoint(args, found: Dict) -> None:
    checkpoint, restore = found["checkpoint"], found["restore"]
    if checkpoint is None:
        return
    budget = size_from("--row-memory", args.row_memory)
    print()
    print(f"### Its checkpoint, and a restore onto {restore.shards} shards")
    print()
    print(f"At the end of the first billion run's window, `ps-ctl checkpoint` (`--checkpoint-dir` beside the row "
          f"store, `--push-log off`); then `ps-server --shards {restore.shards} --restore <it>` with the same job, "
          f"`--row-store` and `--row-memory {args.row_memory}`, and one worker, until it trained {RESTORE_STEPS} "
          f"steps past the checkpoint's. Each shard's resident memory read every {FAST_POLL} s while either ran, "
          "and its `VmHWM` (the checkpoint's reset as it began).")
    print()
    print("| the checkpoint | |")
    print("|---|---:|")
    shards = len(checkpoint.rss_before)
    for label, value in (
            ("`ps-ctl checkpoint`, seconds", f"{checkpoint.seconds:,.1f}"),
            ("step", f"{checkpoint.step:,}"),
            ("rows in its files (every dynamic table's)", f"{checkpoint.rows:,}"),
            ("rows the shards held after it (`dynamic.rows` + `rows_on_disk`)", f"{checkpoint.rows_reported:,.0f}"),
            ("bytes on disk", f"{checkpoint.bytes / 2 ** 20:,.1f} MiB ({checkpoint.bytes / max(1, checkpoint.rows):,.0f}"
                              " per row)"),
            ("rows per second", f"{checkpoint.rows / checkpoint.seconds:,.0f}"),
            ("each shard's resident memory as it was asked for", mib_list(checkpoint.rss_before)),
            ("each shard's resident memory at most while it ran", mib_list(checkpoint.peak_rss)),
            ("`--row-memory` (each shard's budget)", f"{budget / 2 ** 20:,.0f} MiB")):
        print(f"| {label} | {value} |")
    print()
    print(f"| the restore onto {restore.shards} shards | |")
    print("|---|---:|")
    for label, value in (
            ("ps-server started -> ready, seconds", f"{restore.ready_seconds:,.1f}"),
            ("ps-server started -> the worker's first step past the checkpoint's, seconds",
             f"{restore.trained_seconds:,.1f}"),
            ("rows the shards read from the checkpoint (their logs)", f"{restore.rows_read:,}"),
            ("rows restored (`dynamic.rows` + `rows_on_disk` - `admitted`)", f"{restore.rows_reported:,.0f}"),
            (f"rows in memory / on disk, {RESTORE_STEPS} steps on", f"{restore.rows_in_memory:,.0f} / "
                                                                    f"{restore.rows_on_disk:,.0f}"),
            (f"each shard's rows in memory then, counted at {ROW_BYTES} bytes each",
             mib_list([round(held * ROW_BYTES) for held in restore.held])),
            ("each shard's resident memory before its tables were made", mib_list(restore.start_rss)),
            ("each shard's resident memory at most (`VmHWM`)", mib_list(restore.peak_rss)),
            (f"each shard's resident memory {RESTORE_STEPS} steps on", mib_list(restore.end_rss))):
        print(f"| {label} | {value} |")
    print()
    every = checkpoint.rows == restore.rows_read == round(restore.rows_reported)
    print(f"* rows: the checkpoint holds {checkpoint.rows:,}; the {restore.shards} shards restored "
          f"{restore.rows_read:,} ({restore.rows_reported:,.0f} by their figures): "
          + ("every row came back." if every else "THEY DIFFER."))
    per_row = checkpoint.rise / max(1.0, checkpoint.rows / shards)
    print(f"* memory during the checkpoint: a shard's resident memory rose by up to {checkpoint.rise / 2 ** 20:,.0f} "
          f"MiB over its level in training (which holds the rows `--row-memory` allows and the overheads "
          f"docs/row-store.md states), about {per_row:,.0f} bytes per row a shard wrote: "
          + ("within the budget plus the stated overhead (a rise under "
             f"{NOISE_BYTES / 2 ** 20:.0f} MiB is taken as noise)." if checkpoint.rise <= NOISE_BYTES else
             f"NOT within the budget plus the stated overhead. A shard writes its part with one `torch.save`: "
             f"the whole entry, its rows on disk included, is in memory meanwhile (at this rate a shard writing "
             f"500,000,000 rows would take {per_row * 5e8 / 2 ** 30:,.0f} GiB more).")
          )
    excess = restore.excess()
    if excess is None:
        print("* memory during the restore: n/a (a shard had made its tables when the status first showed it)")
    else:
        print(f"* memory during the restore: a shard's peak passed its memory before its tables were made, plus "
              f"its rows in memory at {ROW_BYTES} bytes each (what `--row-memory` counts), by up to "
              f"{excess / 2 ** 20:,.0f} MiB, and its memory {RESTORE_STEPS} steps on by up to "
              f"{restore.rise / 2 ** 20:,.0f} MiB (what a shard holds to train besides its rows is in the first "
              "figure, not in the second; the checkpoint's files, memory-mapped, in both): "
              + ("within the budget plus the stated overhead (up to "
                 f"{NOISE_BYTES / 2 ** 20:.0f} MiB taken as noise)." if excess <= NOISE_BYTES else
                 "NOT within the budget plus the stated overhead. Each shard reads every part of the checkpoint "
                 "whole (memory-mapped), joins every part's rows and picks its own, before the rows past its "
                 "capacity go to its store."))


def files_left(runs: List[Run]) -> None:
    left = [path for run in runs for path in run.files_left]
    print(f"* row store files left after the shards stopped: {len(left)}" + (f" ({left[:5]})" if left else ""))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=("memory", "billion", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="smoke run: 300 steps, one round, 30 seconds")
    parser.add_argument("--steps", type=int, default=None, help="steps of each 20%%-in-memory run (default 1500)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of (a) and of (b) each (default 2)")
    parser.add_argument("--in-memory", type=float, default=0.2, help="share of (a)'s rows (b) holds (default 0.2)")
    parser.add_argument("--vocab", type=int, nargs="+", default=list(DEFAULT_VOCAB),
                        help="the 20%%-in-memory case's vocabulary sizes (bags: the job's default)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids (default 1.05)")
    parser.add_argument("--seconds", type=float, default=None, help="the billion case's time measured (default 120)")
    parser.add_argument("--warm-steps", type=int, default=50, help="steps before the billion case measures")
    parser.add_argument("--billion-rounds", type=int, default=1, help="runs of each billion-case contestant")
    parser.add_argument("--big-vocab", type=int, default=1_000_000_000)
    parser.add_argument("--reference-vocab", type=int, default=20_000_000)
    parser.add_argument("--row-memory", default="64MiB",
                        help="the billion case's --row-memory per shard (default 64MiB: a third of the rows its "
                             "two minutes touch)")
    parser.add_argument("--restore-shards", type=int, default=3,
                        help="shards the billion run's checkpoint is restored onto (default 3)")
    parser.add_argument("--engine", default="log", help="--row-store-engine (default log)")
    parser.add_argument("--staleness", type=int, default=0,
                        help="the job's staleness in every run (default 0: each step's rows read after the push "
                             "before it; 1: read a step ahead, off the step's path)")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between status polls (default 0.5)")
    parser.add_argument("--scratch", default=None, help="folder for logs and the row store (default: a new one in "
                                                        "the system's temporary folder, on local disk)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (300 if args.quick else 1500)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.seconds = args.seconds or (30.0 if args.quick else 120.0)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    print(f"# Row store: `ps-server --row-store`, {os.cpu_count()} cores, 1-min load average "
          f"{os.getloadavg()[0]:.1f} before")
    print()
    with tempfile.TemporaryDirectory(prefix="row_store-", dir=args.scratch) as scratch:
        if args.case in ("memory", "both"):
            report_memory(args, memory_case(args, pathlib.Path(scratch)))
        if args.case in ("billion", "both"):
            found = billion_case(args, pathlib.Path(scratch))
            report_billion(args, found)
            report_checkpoint(args, found)
    print(f"\n1-min load average {os.getloadavg()[0]:.1f} after; {time.monotonic() - began:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
