"""Live exports kept to the newest few: is the export root's size flat, and each process's memory, over time?

What it measures
    The default CTR job (``paramserver.jobs.ctr``, its planted data: it trains for as long as it runs) on this
    machine through the real commands: ``ps-server --shards 1`` with ``--export-dir`` (a temporary directory),
    ``--export-every``, ``--export-base-every`` and ``--keep-exports``, and ``--workers`` ``ps-worker``
    processes in one trainer group, for ``--minutes`` (30 by default).  Every ``--sample`` seconds it prints
    one row: the minutes since the group began, the resident memory (VmRSS) of every process of the cluster
    (``ps-server``, its fork server and the shard process it started, each worker; found through /proc),
    and the export root's
    folders, bases and size.  The grace a superseded chain keeps for its readers is ``--grace`` seconds
    (``PARAMSERVER_EXPORT_READ_GRACE``, handed to the workers).

Target
    Once ``--keep-exports`` bases exist and one grace has passed (the warm-up), the root's size and each
    process's memory stay flat: the largest figure after the warm-up is at most 1.5x the first (the root
    holds between K and K + 1 chains as bases come and go: a chain of ``--export-base-every`` exports).  Each
    says PASS or BELOW; exit 0 either way.  Without retention (``--keep-exports 0``) the root grows with the
    run.

How to run
    ``.venv/bin/python benchmarks/export_retention.py [--minutes 30] [--export-every 200] [--export-base-every 4]
    [--keep-exports 2] [--grace 60] [--sample 30] [--workers 1] [--batch-size 1024]``.  Progress on stderr, the
    table on stdout.
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from paramserver.checkpoint import live_export
from paramserver.cli.demo import LocalProcesses, wait_for_ready
from paramserver.filesystems import locate
from paramserver.train.live_exports import READ_GRACE_ENV

STOPS_WITHIN = 60.0
#: How long the workers may take to form their group and train a first step.
FORMED_WITHIN = 180.0


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def children_of(pid: int) -> List[int]:
    """Every descendant of ``pid`` (from /proc's children lists)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as listing:
                kids = [int(kid) for kid in listing.read().split()]
        except OSError:
            continue
        found += kids
        queue += kids
    return found


def resident_mb(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def kind_of(pid: int) -> str:
    """What a child of a command is: multiprocessing's resource tracker, a fork server, or a process a fork
    server started (ps-server's shard)."""
    def command(of: int) -> str:
        try:
            with open(f"/proc/{of}/cmdline") as cmdline:
                return cmdline.read()
        except OSError:
            return ""
    if "resource_tracker" in command(pid):
        return "resource tracker"
    try:
        with open(f"/proc/{pid}/stat") as stat:
            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        parent = 0
    if "forkserver" in command(parent):
        return f"child {pid}"
    return "fork server" if "forkserver" in command(pid) else f"process {pid}"


def cluster_memory(processes: LocalProcesses) -> Dict[str, float]:
    """Resident MB of every process of the cluster, by a name: ``ps-server``, ``ps-server fork server``,
    ``ps-server child <pid>`` (its shard), ``ps-worker0``, ..."""
    memory = {}
    for name, process in processes.started.items():
        for pid, label in [(process.pid, name)] + [(kid, f"{name} {kind_of(kid)}")
                                                    for kid in children_of(process.pid)]:
            rss = resident_mb(pid)
            if rss is not None:
                memory[label] = rss
    return memory


def root_figures(root: pathlib.Path) -> Tuple[int, int, float]:
    """The export root's folders, committed bases, and size in MB."""
    folders = [entry for entry in root.iterdir() if entry.is_dir()] if root.exists() else []
    size, bases = 0, 0
    for folder in folders:
        try:
            bases += json.loads((folder / live_export.MANIFEST).read_text())["kind"] == "base"
        except (OSError, ValueError):
            pass  # being written, or removed meanwhile
        for path in folder.rglob("*"):
            try:
                size += path.stat().st_size
            except OSError:
                pass
    return len(folders), bases, size / 1e6


def started(processes: LocalProcesses, names: List[str], root: pathlib.Path) -> None:
    """Wait until the first export is committed (the group formed and trains)."""
    deadline = time.monotonic() + FORMED_WITHIN
    while not live_export.chain(locate(str(root))):
        for name, process in processes.started.items():
            if process.poll() is not None:
                raise processes.failure(name, f"exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no live export within {FORMED_WITHIN:.0f} s; logs in {processes.log_dir}")
        time.sleep(0.5)


def run(args) -> List[Dict]:
    rows: List[Dict] = []
    with tempfile.TemporaryDirectory(prefix="export_retention-") as scratch:
        folder = pathlib.Path(scratch)
        root, logs = folder / "exports", folder / "logs"
        logs.mkdir()
        os.environ[READ_GRACE_ENV] = str(args.grace)  # the workers inherit it
        processes = LocalProcesses(logs)
        config = {"steps": 10 ** 9, "batch_size": args.batch_size, "hook": "allreduce", "eval_every": 10 ** 9,
                  "log_every": 10 ** 9, "holdout_size": 1024}
        host_processes = 2 + args.workers
        retention = ["--keep-exports", str(args.keep_exports)] if args.keep_exports else []
        server = processes.start("ps-server", "paramserver.cli.server", "--shards", "1", "--port", "0",
                                 "--group-size", str(args.workers), "--job-config", json.dumps(config),
                                 "--export-dir", str(root), "--export-every", str(args.export_every),
                                 "--export-base-every", str(args.export_base_every), *retention,
                                 host_processes=host_processes)
        address = None
        try:
            address = wait_for_ready(processes, server)
            names = [f"ps-worker{index}" for index in range(args.workers)]
            for name in names:
                processes.start(name, "paramserver.cli.worker", "--connect", address, host_processes=host_processes)
            started(processes, names, root)
            began = time.monotonic()
            progress(f"cluster at {address}: the first export is written; sampling every {args.sample:g} s for "
                     f"{args.minutes:g} minutes")
            while True:
                folders, bases, size = root_figures(root)
                rows.append({"minutes": (time.monotonic() - began) / 60, "folders": folders, "bases": bases,
                             "mb": size, "memory": cluster_memory(processes)})
                print_row(rows[-1], header=len(rows) == 1)
                if time.monotonic() - began >= args.minutes * 60:
                    break
                time.sleep(args.sample)
                for name, process in processes.started.items():
                    if process.poll() is not None:
                        raise processes.failure(name, f"exited with {process.returncode}")
        finally:
            if address is not None:
                processes.shut_down(address, STOPS_WITHIN)
            processes.reap()
    return rows


def print_row(row: Dict, header: bool) -> None:
    names = sorted(row["memory"])
    if header:
        print("| minutes | folders | bases | root (MB) | " + " | ".join(f"{name} RSS (MB)" for name in names) + " |")
        print("|---:" * (4 + len(names)) + "|")
    print(f"| {row['minutes']:.1f} | {row['folders']} | {row['bases']} | {row['mb']:.1f} | "
          + " | ".join(f"{row['memory'].get(name, float('nan')):.0f}" for name in names) + " |", flush=True)


def report(rows: List[Dict], args) -> None:
    """The flatness verdicts, judged after the warm-up: K bases existed and one grace passed since."""
    warm_at = next((row["minutes"] for row in rows if row["bases"] >= max(args.keep_exports, 1)), None)
    after = [row for row in rows if warm_at is not None and row["minutes"] >= warm_at + args.grace / 60]
    if len(after) < 2:
        print(f"\nthe run ended before {args.keep_exports} bases existed and a grace passed: no verdict "
              "(run longer, or export more often)")
        return
    print(f"\nafter the warm-up (minute {after[0]['minutes']:.1f} on, {len(after)} samples): first / largest / last")
    figures = [("export root (MB)", [row["mb"] for row in after]),
               ("export folders", [row["folders"] for row in after])]
    for name in sorted(after[0]["memory"]):
        figures.append((f"{name} RSS (MB)", [row["memory"][name] for row in after if name in row["memory"]]))
    for name, values in figures:
        verdict = "PASS" if max(values) <= 1.5 * values[0] else "BELOW"
        print(f"  {name}: {values[0]:.1f} / {max(values):.1f} / {values[-1]:.1f}: largest "
              f"{max(values) / values[0]:.2f}x the first {verdict}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to sample (default 30)")
    parser.add_argument("--export-every", type=int, default=200, help="steps between exports (default 200)")
    parser.add_argument("--export-base-every", type=int, default=4, help="every N-th export a base (default 4)")
    parser.add_argument("--keep-exports", type=int, default=2, help="bases kept (default 2; 0: every export stays)")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds a superseded chain stays for its readers (default 60)")
    parser.add_argument("--sample", type=float, default=30.0, help="seconds between samples (default 30)")
    parser.add_argument("--workers", type=int, default=1, help="workers in the trainer group (default 1)")
    parser.add_argument("--batch-size", type=int, default=1024,
                        help="the job's batch size (default 1024, the job's own)")
    args = parser.parse_args(argv)
    if min(args.minutes, args.sample) <= 0 or min(args.export_every, args.export_base_every, args.workers) < 1 \
            or args.keep_exports < 0 or args.grace < 0:
        parser.error("--minutes and --sample must be more than 0; --export-every, --export-base-every and "
                     "--workers at least 1; --keep-exports and --grace not negative")
    print(f"export retention: the CTR job, {args.workers} worker(s), an export every {args.export_every} steps, "
          f"a base every {args.export_base_every}, keep {args.keep_exports}, grace {args.grace:g} s\n")
    report(run(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
