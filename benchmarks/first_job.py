"""The README's first job, started by hand as the README says, against the same job with the threads set by hand.

What it measures
    The README's "A first job" (its ``# myjob.py`` block, written to a file) on this machine: ``ps-server
    --shards 2 --job myjob.py:main --job-config '{"steps": N}'`` and two ``ps-worker --connect``, each process
    started alone.  Variant "as the README says": nothing in the environment, so each process learns from the
    coordinator how many of the cluster's processes share this host (``paramserver.runtime.threads``).
    Variant "set by hand": ``PARAMSERVER_HOST_PROCESSES=5`` (coordinator, 2 shards, 2 workers) in every
    command, as ``ps-demo`` sets it.  Samples/s: the mean of the two workers' own figure at the end of the job.
    The variants alternate, ``--rounds`` times each; the ratio is of the medians.  Each run also counts the
    lines that contain ``error`` or ``Warning`` in any of its processes' output, the shutdown included
    (``ps-ctl shutdown`` once both workers finished): a normal end prints none.

Target
    "as the README says" at least 0.9x the samples/s of "set by hand" (PASS or BELOW; exit 0 either way).

How to run
    ``.venv/bin/python benchmarks/first_job.py [--steps 300] [--rounds 1]``: about 40 s a run on 2 cores.
    Progress on stderr, results on stdout as a markdown table.
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

from paramserver.cli.demo import LocalProcesses, wait_for_ready
from paramserver.runtime.threads import HOST_PROCESSES_ENV, INTEROP_THREADS_ENV, THREADS_ENV

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET = 0.9
BY_HAND = 5  # the coordinator, 2 shards, 2 workers: all on this host
FINISHED = re.compile(r"finished \S+ at step (\d+) \(.*samples_per_s=([0-9.e+]+)")
NOISE = re.compile(r"error|Warning")


def readme_job() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(# myjob\.py[^\n]*\n.*?)```", text, re.S)
    if len(blocks) != 1:
        raise SystemExit(f"README.md should have one python block starting with '# myjob.py', has {len(blocks)}")
    return blocks[0]


def run_once(folder: pathlib.Path, job: pathlib.Path, steps: int, host_processes) -> dict:
    """One cluster, two workers, the job to its end, then ``ps-ctl shutdown``: the workers' mean samples/s and
    the noisy lines of every process."""
    folder.mkdir(parents=True)
    processes = LocalProcesses(folder)
    try:
        server = processes.start("ps-server", "paramserver.cli.server", "--shards", "2", "--port", "0",
                                 "--job", f"{job}:main", "--job-config", json.dumps({"steps": steps}),
                                 host_processes=host_processes)
        address = wait_for_ready(processes, server)
        workers = [processes.start(f"ps-worker{i}", "paramserver.cli.worker", "--connect", address,
                                   host_processes=host_processes) for i in range(2)]
        rates = []
        for index, worker in enumerate(workers):
            if worker.wait(600) != 0:
                raise processes.failure(f"ps-worker{index}", f"exited with code {worker.returncode}")
            match = FINISHED.search((folder / f"ps-worker{index}.out").read_text())
            if match is None or int(match.group(1)) != steps:
                raise processes.failure(f"ps-worker{index}", "did not finish the job")
            rates.append(float(match.group(2)))
        shutdown = subprocess.run([sys.executable, "-m", "paramserver.cli.ctl", "--connect", address, "shutdown"],
                                  capture_output=True, text=True, timeout=60)
        if server.wait(60) != 0:
            raise processes.failure("ps-server", f"exited with code {server.returncode}")
        texts = [path.read_text(errors="replace") for path in sorted(folder.glob("*.out")) + sorted(folder.glob("*.log"))]
        noise = [line for text in texts + [shutdown.stdout + shutdown.stderr] for line in text.splitlines()
                 if NOISE.search(line)]
        return {"samples_per_s": statistics.fmean(rates), "noise": noise}
    finally:
        processes.reap()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="the job's steps (the README's: 300)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, alternating (default 1)")
    args = parser.parse_args(argv)
    for name in (HOST_PROCESSES_ENV, THREADS_ENV, INTEROP_THREADS_ENV):
        os.environ.pop(name, None)  # as a new user starts it: nothing set
    variants = {"as the README says": None, f"set by hand ({HOST_PROCESSES_ENV}={BY_HAND})": BY_HAND}
    results = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="first-job-") as tmp:
        root = pathlib.Path(tmp)
        job = root / "myjob.py"
        job.write_text(readme_job())
        for round_ in range(args.rounds):
            for index, (name, host_processes) in enumerate(variants.items()):
                began = time.monotonic()
                result = run_once(root / f"run{round_}-{index}", job, args.steps, host_processes)
                results[name].append(result)
                print(f"{name}: {result['samples_per_s']:,.0f} samples/s, {len(result['noise'])} noisy lines "
                      f"({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
                for line in result["noise"][:3]:
                    print(f"    {line[:200]}", file=sys.stderr)
    medians = {name: statistics.median(r["samples_per_s"] for r in runs) for name, runs in results.items()}
    readme, by_hand = medians.values()
    ratio = readme / by_hand
    print(f"| variant | samples/s (median of {args.rounds}) | lines with error/Warning |")
    print("|---|---|---|")
    for name, runs in results.items():
        print(f"| {name} | {medians[name]:,.0f} | {sum(len(r['noise']) for r in runs)} |")
    print(f"\nas the README says / set by hand: **{ratio:.2f}x** (target >= {TARGET}x: "
          f"{'PASS' if ratio >= TARGET else 'BELOW'}), {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
