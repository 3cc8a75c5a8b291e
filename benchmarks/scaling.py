"""How the default job scales with workers and shards on this machine, and what a shard's memory costs.

What it measures
    * **Throughput**: samples/s of the default CTR job (``ps-demo --hook
      allreduce``, no evaluation, batch 1024 per worker, all workers in one
      trainer group) for 1, 2, 4 and 8 workers on 4 shards (``--worker-shards``), then 2, 4 and 8
      shards with 2 workers.  Efficiency of a row: its samples/s over
      (workers x the samples/s of 1 worker on as many shards), from the same run.
      Every process sizes its threads to the host (``PARAMSERVER_HOST_PROCESSES``,
      which ps-demo sets: ``paramserver.runtime.threads``), so a worker of
      the 1-worker run gets more intra-op threads than one of the 8-worker
      run; ``--threads N`` gives every process N instead
      (``PARAMSERVER_THREADS``), which shows the job's own scaling apart
      from that split of the host.
    * **How busy the host was** in each run: the share of its cores busy
      while the workers trained (``/proc/stat``, from a worker's first
      logged step to the last), so that a run short of CPU shows apart from
      one whose workers wait for each other.
    * **Resident memory per shard** in each run: the highest resident set
      of any shard process seen while it ran (sampled every 0.5 s), next to
      the floor its tables need (rows + QHM momentum, 4-byte floats).  For
      the default job's small tables the interpreter and torch dominate, so:
    * **Memory at the floor**: one shard hosting a ``--memory-rows`` x 16
      table (default 20M) with QHM's momentum, after a fused step through
      it; the growth of its resident set over the floor (rows + momentum).
    * **Where a step's time goes** in each run: the Trainer's phase figures
      (``phase_ms.*``, ms per step, the workers' mean) and how long the
      all-reduce was in flight within the backward (``allreduce_ms``), so
      that what grows with the workers (the all-reduce and its wait for the
      slowest worker, the lookups, the push wait) can be told apart.  Next
      to it, the same all-reduce (the job's gradient bucket, gloo, loopback)
      between as many idle processes, measured after the run: what the
      collective itself costs, so that the rest of its time in flight is the
      wait for the slowest worker.

    With more processes than cores (8 workers and 4 shards on 2 cores), the
    throughput rows show what a step costs in CPU over all processes, not
    scaling; run it on a machine with more cores for that (the docs table
    names the machine).

How to run
    ``.venv/bin/python benchmarks/scaling.py [--steps N] [--workers 1,2,4,8] [--worker-shards N] [--shards 2,4,8]
    [--threads N] [--job-config JSON] [--memory-rows N]``; the defaults take about 2 minutes on 2 cores.
    Progress to stderr, results to stdout.
"""

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # end_to_end, also in spawned children

from end_to_end import FORK_SERVER, ContestantFailed, run_demo, step_figures, threads_environment  # noqa: E402

from paramserver.jobs.ctr_data import CTRSpec  # noqa: E402
from paramserver.processes import Child, free_port, run_children  # noqa: E402
from paramserver.train.step import PHASES  # noqa: E402

DIM = 16
TARGET_EFFICIENCY = 0.70
MEMORY_TARGET = 0.05  # growth over the floor


def progress(message: str) -> None:
    print(f"[scaling] {message}", file=sys.stderr, flush=True)


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> List[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                found += [int(child) for child in children.read().split()]
    except OSError:
        pass
    return found


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read()


class ShardMemory:
    """The highest resident set of each shard process of a ps-demo run: the children of ps-server's fork
    server (``paramserver.runtime.supervisor`` starts them there; they carry its command line), or of
    ps-server itself when spawned."""

    def __init__(self):
        self.peak: Dict[int, int] = {}

    def __call__(self, log_dir: pathlib.Path) -> None:
        try:
            server = json.loads((log_dir / "pids.json").read_text())["ps-server"]
        except (OSError, ValueError, KeyError):
            return
        shards = []
        for child in _children(server):
            try:
                command = _cmdline(child)
            except OSError:
                continue
            if FORK_SERVER.encode() in command:
                shards += _children(child)  # the fork server's children are the shard processes
            elif b"spawn_main" in command:
                shards.append(child)  # (anything else: multiprocessing's resource tracker)
        for shard in shards:
            try:
                self.peak[shard] = max(self.peak.get(shard, 0), resident_bytes(shard))
            except OSError:
                continue


class HostBusy:
    """How busy the host's cores were while a run trained: ``/proc/stat``'s totals, read at each call from the
    first worker's first logged step (its Trainer's start line) to the logged last step of one."""

    def __init__(self, steps: int):
        self._last_step = f" step {steps}/{steps}:"
        self.began: Optional[tuple] = None  # (busy ticks, all ticks) when training began
        self.ended: Optional[tuple] = None

    def __call__(self, log_dir: pathlib.Path) -> None:
        if self.ended is not None:
            return
        logs = "".join(path.read_text(errors="replace") for path in log_dir.glob("ps-worker*.log"))
        if self.began is None and ": tables " not in logs:
            return
        with open("/proc/stat") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:]]
        reading = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))  # all but idle and iowait
        if self.began is None:
            self.began = reading
        elif self._last_step in logs:
            self.ended = reading

    def share(self) -> float:
        """The share of the cores busy while training (0 to 1; 0 when the run was too short to tell)."""
        if self.began is None or self.ended is None:
            return 0.0
        return (self.ended[0] - self.began[0]) / max(1, self.ended[1] - self.began[1])


def job_floor_bytes(shards: int) -> float:
    """Rows + momentum of the default job's tables, per shard on average (whole tables placed by size)."""
    rows = sum(CTRSpec().vocab_sizes)
    return rows * DIM * 4 * 2 / shards


BARE_ROUNDS = 300


def bare_allreduce_member(rank: int, world: int, port: int, numel: int, results_path: str) -> None:
    """One of ``world`` idle processes: ``BARE_ROUNDS`` all-reduces of ``numel`` float32 over gloo, each after a
    barrier (so that every member starts it together); rank 0 writes the median in ms."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    gradient, times = torch.randn(numel), []
    for round_ in range(BARE_ROUNDS + 20):  # 20 untimed
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(gradient)
        if round_ >= 20:
            times.append(time.perf_counter() - began)
    if rank == 0:
        with open(results_path, "w") as results:
            json.dump({"median_ms": 1e3 * statistics.median(times)}, results)
    dist.destroy_process_group()


def bare_allreduce_ms(world: int, numel: int, folder: pathlib.Path) -> float:
    """The median time of the job's all-reduce between ``world`` idle processes (0 for one)."""
    if world < 2 or numel < 1:
        return 0.0
    path, port = str(folder / f"bare-{world}.json"), free_port()
    run_children([Child(f"member{rank}", bare_allreduce_member, (rank, world, port, numel, path))
                  for rank in range(world)], datetime.timedelta(seconds=120))
    with open(path) as results:
        return json.load(results)["median_ms"]


def throughput_rows(args, folder: pathlib.Path) -> List[Dict]:
    on = args.worker_shards
    shapes = [(w, on) for w in args.workers] + [(2, s) for s in args.shards if s != on or 2 not in args.workers]
    rows = []
    for workers, shards in shapes:
        progress(f"{workers} workers, {shards} shards, {args.steps} steps")
        memory, busy = ShardMemory(), HostBusy(args.steps)
        run_folder = folder / f"w{workers}-s{shards}"
        run_folder.mkdir()

        def watch(log_dir: pathlib.Path) -> None:
            memory(log_dir)
            busy(log_dir)
        summary = run_demo(run_folder, args.steps, args.batch, max(10, args.steps // 5), args.timeout,
                           "--workers", str(workers), "--shards", str(shards), watch=watch,
                           environment=threads_environment(args.threads), extra_config=args.job_config)
        progress(f"  {summary['samples_per_s']:,.0f} samples/s; the bare all-reduce between {workers} idle processes")
        bare = bare_allreduce_ms(workers, summary.get("bytes_per_step", 0) // 4, run_folder)
        rows.append({"workers": workers, "shards": shards, "samples_per_s": summary["samples_per_s"],
                     "shard_peak_mib": max(memory.peak.values(), default=0) / 2**20,
                     "floor_mib": job_floor_bytes(shards) / 2**20, "bare_allreduce_ms": bare,
                     "host_busy": busy.share(),
                     **step_figures(summary)})
    return rows


def memory_probe(rows: int, results_path: str) -> None:
    """In a trainer of a one-shard local cluster: the shard's resident set before and after hosting a
    ``rows`` x 16 table with QHM momentum, after one fused step."""
    import torch
    import torch.distributed.rpc as rpc

    from paramserver.optim import QHM, DistributedOptimizer
    from paramserver.shards import EmbeddingCollection, ShardedEmbeddingBag

    before = rpc.rpc_sync("shard0", _own_resident_bytes)
    table = ShardedEmbeddingBag(rows, DIM, shards=["shard0"], name="big", seed=0, init_std=0.01)
    optimizer = DistributedOptimizer(QHM, table.remote_parameters(), lr=0.1, momentum=0.9, nu=0.7)
    collection = EmbeddingCollection({"big": table}, optimizer.owner_layout(), rpc.get_worker_info().name)
    lookup = collection.lookup({"big": torch.randint(0, rows, (1024, 1))})
    lookup.pooled()["big"].sum().backward()
    lookup.push().wait()
    after = rpc.rpc_sync("shard0", _own_resident_bytes)
    with open(results_path, "w") as results:
        json.dump({"before": before, "after": after}, results)


def _own_resident_bytes() -> int:
    return resident_bytes(os.getpid())


def memory_row(args, folder: pathlib.Path) -> Dict:
    from paramserver.shards.local import run_local_cluster

    progress(f"one shard hosting {args.memory_rows:,} x {DIM} with QHM momentum")
    path = str(folder / "memory.json")
    run_local_cluster([(memory_probe, (args.memory_rows, path))], 1, timeout=datetime.timedelta(seconds=600))
    with open(path) as results:
        measured = json.load(results)
    floor = args.memory_rows * DIM * 4 * 2
    return {"rows": args.memory_rows, "floor": floor, "growth": measured["after"] - measured["before"]}


def report(rows: List[Dict], memory: Optional[Dict], args) -> None:
    threads = f"{args.threads} intra-op threads per process" if args.threads > 0 else "threads sized to the host"
    config = f", job configuration {json.dumps(args.job_config)}" if args.job_config else ""
    print(f"# Scaling of the default job: {os.cpu_count()} cores, {args.steps} steps x batch {args.batch} per "
          f"worker, allreduce hook, one trainer group, {threads}{config}\n")
    on = args.worker_shards
    base = next((r["samples_per_s"] for r in rows if r["workers"] == 1 and r["shards"] == on), None)
    print("| workers | shards | samples/s | efficiency vs 1 worker | host's cores busy while training | "
          "shard resident (peak, MiB) | tables' floor per shard (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        efficiency = f"{row['samples_per_s'] / (row['workers'] * base):.0%}" if base else "n/a"
        print(f"| {row['workers']} | {row['shards']} | {row['samples_per_s']:,.0f} | {efficiency} | "
              f"{row['host_busy']:.0%} | {row['shard_peak_mib']:,.0f} | {row['floor_mib']:.1f} |")
    print_phases(rows)
    eight = next((r for r in rows if r["workers"] == 8 and r["shards"] == on), None)
    two = next((r for r in rows if r["workers"] == 2 and r["shards"] == on), None)
    if eight and two and base:
        efficiency = eight["samples_per_s"] / (8 * base)
        print(f"\n8 workers vs 2: {eight['samples_per_s'] / two['samples_per_s']:.2f}x; efficiency at 8 workers "
              f"{efficiency:.0%} (target >= {TARGET_EFFICIENCY:.0%} on 16 cores) "
              f"{'PASS' if efficiency >= TARGET_EFFICIENCY else 'BELOW'}")
    if memory:
        over = memory["growth"] / memory["floor"] - 1
        print(f"\nmemory: one shard hosting {memory['rows']:,} x {DIM} + QHM momentum grew "
              f"{memory['growth'] / 2**20:,.0f} MiB for a floor of {memory['floor'] / 2**20:,.0f} MiB: "
              f"{over:+.1%} (target <= {MEMORY_TARGET:.0%} over) {'PASS' if over <= MEMORY_TARGET else 'BELOW'}")


def print_phases(rows: List[Dict]) -> None:
    """Where a step's time goes in each run (ms per step, the workers' mean): what grows with the workers."""
    shown = [phase for phase in PHASES if any(phase in row["phase_ms"] for row in rows)]
    if not shown:
        return
    print("\nWhere a step's time goes (ms per step, the workers' mean; the all-reduce in flight is part of the "
          "backward: from a worker's last gradient bucket to its all-reduce's end, the wait for the slowest "
          "worker included; bare: the same all-reduce between as many idle processes, the median):\n")
    print("| workers | shards | " + " | ".join(PHASES[phase] for phase in shown) +
          " | step | all-reduce in flight | bare all-reduce |")
    print("|---:|---:|" + "---:|" * (len(shown) + 3))
    for row in rows:
        cells = " | ".join(f"{row['phase_ms'].get(phase, 0.0):.2f}" for phase in shown)
        step = sum(row["phase_ms"].get(phase, 0.0) for phase in shown)
        print(f"| {row['workers']} | {row['shards']} | {cells} | {step:.2f} | {row['allreduce_ms']:.2f} | "
              f"{row['bare_allreduce_ms']:.2f} |")


def _counts(text: str) -> List[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="The default job's scaling, and a shard's memory.")
    parser.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    parser.add_argument("--batch", type=int, default=1024, help="samples per worker per step (default 1024)")
    parser.add_argument("--workers", type=_counts, default=[1, 2, 4, 8],
                        help="worker counts on --worker-shards shards")
    parser.add_argument("--worker-shards", type=int, default=4, metavar="N",
                        help="the shards of the worker-count runs (default 4)")
    parser.add_argument("--shards", type=_counts, default=[2, 4, 8], help="shard counts with 2 workers")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="intra-op threads of every process (default 0: each sizes its own to the host)")
    parser.add_argument("--job-config", type=json.loads, default=None, metavar="JSON",
                        help="added to every run's job configuration, e.g. '{\"row_wise_min_rows\": 1000}' "
                             "(tables of 1,000 rows or more split by rows over every shard, not packed whole)")
    parser.add_argument("--memory-rows", type=int, default=20_000_000,
                        help="rows of the memory probe's table (0: skip it; default 20M)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per run (default 600)")
    args = parser.parse_args(argv)
    if args.worker_shards < 1:
        parser.error("--worker-shards must be at least 1")
    with tempfile.TemporaryDirectory(prefix="scaling-") as folder:
        try:
            rows = throughput_rows(args, pathlib.Path(folder))
            memory = memory_row(args, pathlib.Path(folder)) if args.memory_rows > 0 else None
        except ContestantFailed as error:
            print(f"scaling: {error}", file=sys.stderr)
            return 1
    report(rows, memory, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
