"""The demo's samples/s, two ways taken in turn: this checkout against another source tree, and exact
against staleness 2 with the row cache.

    .venv/bin/python benchmarks/demo_alternating.py [--baseline-tree DIR] [--steps N] [--rounds R]

Each run is a whole ``ps-demo --steps N`` (PowerSGD, 4 shards, 2 workers: ``make demo``'s job, fewer
steps), its samples/s read from the one-line summary it prints; the two contestants of a comparison
alternate, the order reversed every other round, so that a machine's drift touches both alike.  Prints
each run, the medians and their ratios.

``--baseline-tree DIR``: a checkout of another commit (``git worktree add DIR COMMIT``, its gRPC stubs
generated into it with ``grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=.``, as an
install does), run with this venv and ``PYTHONPATH=DIR`` (its C kernels are built on first use).  Without
it only exact against staleness 2 runs.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
PS_DEMO = pathlib.Path(sys.executable).parent / "ps-demo"
STALE = {"staleness": 2, "cache_rows": 200_000}
#: A run is given this long before it counts as failed.
RUN_WITHIN_S = 600


def demo_samples_per_s(tree: pathlib.Path, steps: int, config: Optional[Dict]) -> float:
    """One ``ps-demo`` run of ``tree``'s code: the samples/s its summary line reports."""
    args = [str(PS_DEMO), "--steps", str(steps)] + (["--job-config", json.dumps(config)] if config else [])
    done = subprocess.run(args, env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, capture_output=True,
                          text=True, timeout=RUN_WITHIN_S)
    summaries = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not summaries:
        raise RuntimeError(f"ps-demo of {tree} exited {done.returncode}: {done.stderr[-2000:]}")
    return float(json.loads(summaries[-1])["samples_per_s"])


def alternate(contestants: Sequence[tuple], rounds: int, steps: int) -> Dict[str, List[float]]:
    """``contestants``: (name, tree, job config) pairs, run in turn ``rounds`` times, every other round reversed."""
    runs: Dict[str, List[float]] = {name: [] for name, _, _ in contestants}
    for number in range(rounds):
        for name, tree, config in (contestants if number % 2 == 0 else list(reversed(contestants))):
            runs[name].append(demo_samples_per_s(tree, steps, config))
            print(f"  round {number + 1}: {name}: {runs[name][-1]:,.0f} samples/s", flush=True)
    return runs


def report(runs: Dict[str, List[float]], new: str, old: str, target: float) -> None:
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians[new] / medians[old]
    print(f"| {new} / {old} | {medians[new]:,.0f} | {medians[old]:,.0f} | {ratio:.2f}x | "
          f">= {target}x {'PASS' if ratio >= target else 'BELOW'} |")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=pathlib.Path, default=None,
                        help="a checkout of another commit to compare this one with (see the module's docstring)")
    parser.add_argument("--steps", type=int, default=600, help="steps of each demo run (default 600)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each contestant (default 3)")
    args = parser.parse_args(argv)
    print(f"# The demo taken in turn: ps-demo --steps {args.steps}, {args.rounds} rounds; "
          f"1-min load average {os.getloadavg()[0]:.1f} before")
    lines = []
    if args.baseline_tree is not None:
        runs = alternate([("this checkout", ROOT, None), ("baseline", args.baseline_tree.resolve(), None)],
                         args.rounds, args.steps)
        lines.append((runs, "this checkout", "baseline", 1.0))
    runs = alternate([("exact", ROOT, None), ("staleness 2 + cache", ROOT, STALE)], args.rounds, args.steps)
    lines.append((runs, "staleness 2 + cache", "exact", 1.15))
    print(f"\n| ratio | samples/s (median) | against (median) | x | target |\n|---|---:|---:|---:|---|")
    for runs, new, old, target in lines:
        report(runs, new, old, target)
    print(f"1-min load average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
