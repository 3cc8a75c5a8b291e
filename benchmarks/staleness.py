"""Held-out quality of the default job with stale sparse reads: ``staleness=K`` against ``staleness=0``.

What it measures
    The held-out AUC and log loss of the default CTR job (``paramserver/jobs/ctr.py``)
    trained with the Trainer's ``staleness=K`` (a step may read rows missing
    the sparse updates of at most the last K steps, applied in the
    background; ``paramserver.train.pipeline``) next to the same job with
    ``staleness=0`` (exact), and the same staleness with the workers' row
    cache (``"cache_rows"``: the rows of K + 1 steps read at once, their
    pushes sent together; ``paramserver.shards.client.row_cache``), and
    each run's samples/s.  Two jobs: the
    default one on fixed tables, and the same model on dynamic tables
    (job configuration ``"dynamic_tables": true``: ids as raw 64-bit
    hashes, ``Table(None, ...)``).  Every run is ``ps-demo --hook
    allreduce`` (``end_to_end.run_demo``: ps-server with 4 shard servers, 2
    ps-workers in one trainer group), with the same steps, batch and seed
    (the job configuration's ``"seed"``: the same planted data, held-out set
    and initial tables); only ``"staleness"``, ``"cache_rows"`` and
    ``"dynamic_tables"`` differ.  The held-out figures are rank 0's evaluation after the last
    step (the Trainer first waits for every update in flight, so a stale run
    is judged on its fully updated model); there is no evaluation during
    training, which would drain the pipeline mid-run.  samples/s is
    ps-demo's (both workers, from their first training step, the final
    evaluation excluded).

How to run
    ``.venv/bin/python benchmarks/staleness.py [--steps N] [--batch N]
    [--staleness K] [--cache-rows N] [--seed N] [--log-every N] [--timeout
    SECONDS]``; the defaults (1500 steps of batch 1024 per worker, what the
    job was tuned for; K = 2; a cache of 200,000 rows, ``--cache-rows 0``
    leaves that run out; seed 0) run ps-demo six times (``make demo``, 1500 steps,
    takes about a minute on 2 cores; dynamic tables train slower, and each
    run has some 30 s of start-up and evaluation).  With few steps the AUCs
    say little: the target is judged at the job's 1500.  Progress goes to
    stderr, results to stdout.

How to read it
    One row per job and staleness (and cache): held-out AUC, log loss,
    samples/s; the staleness-K rows add the AUC gap (AUC at K minus AUC at 0, same job) and
    PASS when its magnitude is at most 0.005 (the target), BELOW otherwise.
    A negative gap is quality lost to stale reads.  samples/s shows what the
    staleness buys, but this machine is shared and noisy: for throughput,
    ``benchmarks/end_to_end.py --staleness K`` is the measurement; here it is
    only a sanity check.  The script exits 0 whatever the verdicts, 1 if a
    run failed (its row says so).
"""

import argparse
import os
import pathlib
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # end_to_end, a sibling script

from end_to_end import ContestantFailed, run_demo  # noqa: E402

#: Largest |AUC at staleness K - AUC at staleness 0| that passes.
AUC_GAP_TARGET = 0.005
#: The jobs compared: label, and whether the job's tables are dynamic.
JOBS = (("fixed", False), ("dynamic", True))


def progress(message: str) -> None:
    print(f"[staleness] {message}", file=sys.stderr, flush=True)


def job_config(dynamic_tables: bool, staleness: int, seed: int, cache_rows: Optional[int] = None) -> Dict:
    """What a run adds to ps-demo's job configuration (``end_to_end.demo_config`` sets the rest)."""
    cache = {} if cache_rows is None else {"cache_rows": cache_rows}
    return {"dynamic_tables": dynamic_tables, "staleness": staleness, "seed": seed, **cache}


def variants(args) -> List[Tuple[str, int, Optional[int]]]:
    """The runs of each job: (label, staleness, cache rows): exact, stale, stale with the row cache."""
    runs = [("0", 0, None), (str(args.staleness), args.staleness, None)]
    if args.cache_rows:
        runs.append((f"{args.staleness} + cache", args.staleness, args.cache_rows))
    return runs


def run_job(args, folder: pathlib.Path, dynamic_tables: bool, staleness: int,
            cache_rows: Optional[int] = None) -> Optional[Dict]:
    """One ps-demo run's final summary, or None when it failed (the reason goes to stderr)."""
    folder.mkdir()
    try:
        return run_demo(folder, args.steps, args.batch, args.log_every, args.timeout,
                        extra_config=job_config(dynamic_tables, staleness, args.seed, cache_rows))
    except ContestantFailed as error:
        progress(str(error))
        return None


def verdict(gap: float) -> str:
    return "PASS" if abs(gap) <= AUC_GAP_TARGET else "BELOW"


def report(runs: Dict[str, Dict[str, Optional[Dict]]], args, load_before: float) -> None:
    print(f"# Staleness and held-out quality: torch {torch.__version__}, {os.cpu_count()} cores, {args.steps} steps "
          f"x batch {args.batch} per worker, 2 workers, 4 shards, allreduce hook, seed {args.seed}; 1-min load "
          f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print(f"| job | staleness | held-out AUC | log loss | samples/s | AUC gap vs staleness 0 "
          f"| target abs(gap) <= {AUC_GAP_TARGET} |")
    print("|---|---:|---:|---:|---:|---:|---|")
    verdicts: List[str] = []
    for job, by_staleness in runs.items():
        exact = by_staleness["0"]
        for staleness, summary in by_staleness.items():
            if summary is None:
                print(f"| {job} | {staleness} | failed | | | | |")
                continue
            gap_cells = "| | |"
            if staleness != "0" and exact is not None:
                gap = summary["auc"] - exact["auc"]
                gap_cells = f"| {gap:+.4f} | {verdict(gap)} |"
                verdicts.append(f"staleness: {job} tables, AUC at staleness {staleness} minus at 0 = {gap:+.4f} "
                                f"(target abs <= {AUC_GAP_TARGET}) {verdict(gap)}")
            print(f"| {job} | {staleness} | {summary['auc']:.4f} | {summary['log_loss']:.4f} "
                  f"| {summary['samples_per_s']:,.0f} {gap_cells}")
    print()
    for line in verdicts:
        print(line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="The default job's held-out AUC with staleness K vs staleness 0, "
                                                 "on fixed and on dynamic tables.")
    parser.add_argument("--steps", type=int, default=1500, help="training steps per worker (default 1500, the job's)")
    parser.add_argument("--batch", type=int, default=1024, help="samples per worker per step (default 1024)")
    parser.add_argument("--staleness", type=int, default=2, metavar="K",
                        help="the staleness compared with 0 (default 2)")
    parser.add_argument("--cache-rows", type=int, default=200_000, metavar="N",
                        help="the row cache's rows in the third run of each job (default 200,000; 0: no such run)")
    parser.add_argument("--seed", type=int, default=0, help="the job's seed, the same for every run (default 0)")
    parser.add_argument("--log-every", type=int, default=100, help="the job's log_every (default 100)")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="give up on one run after this long (default 900)")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.log_every, args.staleness) < 1 or args.cache_rows < 0:
        parser.error("--steps, --batch, --log-every and --staleness must be at least 1, --cache-rows at least 0")
    load_before = os.getloadavg()[0]
    runs: Dict[str, Dict[str, Optional[Dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="staleness-") as folder:
        for job, dynamic_tables in JOBS:
            runs[job] = {}
            for label, staleness, cache_rows in variants(args):
                progress(f"{job} tables, staleness {label}: {args.steps} steps")
                summary = run_job(args, pathlib.Path(folder) / f"{job}-{staleness}-{cache_rows or 0}",
                                  dynamic_tables, staleness, cache_rows)
                if summary is not None:
                    progress(f"  AUC {summary['auc']:.4f}, log loss {summary['log_loss']:.4f}, "
                             f"{summary['samples_per_s']:,.0f} samples/s, {summary['seconds']:.0f} s")
                runs[job][label] = summary
    report(runs, args, load_before)
    return 1 if any(summary is None for by_staleness in runs.values() for summary in by_staleness.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
