"""The push log's price and what it buys: the default job with and without it, and a shard killed between checkpoints.

What it measures
    ``make demo``'s job (``ps-demo``: 4 shards, 2 workers, PowerSGD) with checkpoints every
    ``--checkpoint-every`` steps, each run a whole ``ps-demo`` as a subprocess:

    * **cost**: samples/s with the push log (the default once checkpoints are on) against
      ``--push-log off``, the two alternating, the order reversed every other round, exact and with staleness 2
      and the row cache; and the bytes the shards appended to their logs per step, and the milliseconds per
      step their writes took (checksums included; from each shard's last log line). Target: the log costs at
      most 5% (ratio >= 0.95).
    * **a killed shard**: one run each way in which the shard holding most of the tables is SIGKILLed half
      way between two checkpoints: the steps lost (the workers' ``sparse_steps_lost``: with no log, every step
      rolled back on that shard), the pushes replayed, how long the replay took against the training of the
      same steps (target: at least 10x faster), and the seconds from the kill until the workers trained again,
      against the heartbeat timeout + the restore + the replay (target: within).

How to run
    ``.venv/bin/python benchmarks/push_log.py [--steps 600] [--rounds 3] [--checkpoint-every 200]``; progress
    on stderr, markdown tables on stdout.  On a quiet machine: every run is a whole cluster on its cores.
"""

import argparse
import datetime
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from paramserver.cli.ctl import status_as_dict
from paramserver.control import CoordinatorClient

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PS_DEMO = pathlib.Path(sys.executable).parent / "ps-demo"
BATCH, WORKERS = 1024, 2
STALE = {"staleness": 2, "cache_rows": 200_000}
HEARTBEAT_TIMEOUT_S = 5.0
RUN_WITHIN_S = 900
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def stamp(line: str) -> float:
    """The wall-clock time a log line was written at (its ``YYYY-MM-DD HH:MM:SS,mmm`` prefix)."""
    found = _STAMP.match(line)
    return datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if found else 0.0


def demo(folder: pathlib.Path, steps: int, checkpoint_every: int, push_log: bool, config: Optional[Dict] = None,
         kill_at: Optional[int] = None, victim: Optional[str] = None) -> Dict:
    """One ``ps-demo`` run; its summary line, with ``kill`` (the wall time a shard was SIGKILLed at, and its
    name) when ``kill_at`` names the step to do it at (``victim``: that shard; by default the one whose push
    log is the largest)."""
    folder.mkdir(parents=True)
    flags = f"--checkpoint-dir {folder / 'checkpoints'} --checkpoint-every {checkpoint_every} " \
            f"--heartbeat-timeout {HEARTBEAT_TIMEOUT_S:g}" + ("" if push_log else " --push-log off")
    job = dict(config or {}, batch_size=BATCH, eval_every=1_000_000, log_every=50)
    command = [str(PS_DEMO), "--steps", str(steps), "--workers", str(WORKERS), "--job-config", json.dumps(job),
               "--log-dir", str(folder / "logs"), "--server-flags", flags]
    with open(folder / "out", "w") as out, open(folder / "err", "w") as err:
        run = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                               start_new_session=True)
    killed = None
    try:
        if kill_at is not None:
            killed = kill_a_shard(folder / "err", run, kill_at, victim)
        code = run.wait(RUN_WITHIN_S)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.wait(60)
    summaries = [line for line in (folder / "out").read_text().splitlines() if line.startswith("{")]
    if code != 0 or not summaries:
        raise RuntimeError(f"ps-demo exited {code}: {(folder / 'err').read_text()[-3000:]}")
    summary = json.loads(summaries[-1])
    summary["kill"] = killed
    return summary


def kill_a_shard(err: pathlib.Path, run: subprocess.Popen, step: int, victim: Optional[str]) -> Dict:
    """SIGKILL shard ``victim`` (``None``: the one whose push log is the largest: it serves the most) once every
    worker is past ``step``; when and which."""
    deadline = time.monotonic() + RUN_WITHIN_S
    address = None
    while address is None:
        found = re.search(r"cluster ready at (\S+)", err.read_text()) if err.exists() else None
        address = found.group(1) if found else None
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ps-demo ended before its cluster was ready: {err.read_text()[-2000:]}")
        time.sleep(0.2)
    client = CoordinatorClient(address)
    try:
        while True:
            state = status_as_dict(client.status())
            workers = [w for w in state["workers"] if w["alive"]]
            if len(workers) == WORKERS and min(w["step"] for w in workers) >= step:
                break
            if run.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the workers never reached step {step}")
            time.sleep(0.1)
    finally:
        client.close()
    alive = [s for s in state["shards"] if s["alive"]]
    shard = next(s for s in alive if s["name"] == victim) if victim is not None else \
        max(alive, key=lambda s: s["metrics"].get("push_log.bytes", 0.0))
    os.kill(shard["pid"], signal.SIGKILL)
    progress(f"  SIGKILLed {shard['name']} (pid {shard['pid']}) at step {step}")
    return {"at": time.time(), "shard": shard["name"]}


def appended(folder: pathlib.Path) -> Tuple[float, float]:
    """The bytes every shard appended to its push log, and the seconds its writes took (checksums included),
    summed over the shards (their last lines say so as they exit)."""
    text = (folder / "logs" / "ps-server.log").read_text(errors="replace")
    found = re.findall(r"push log: \d+ records, ([\d.]+) MB appended in \d+ writes \(([\d.]+) s\)", text)
    return sum(float(mb) * 1e6 for mb, _ in found), sum(float(seconds) for _, seconds in found)


def recovery(folder: pathlib.Path, summary: Dict) -> Dict:
    """From a run with a kill: the replay's pushes, seconds and steps; the seconds from the kill until the
    workers trained again, and the restart's parts (until the shard served, the replay)."""
    server = (folder / "logs" / "ps-server.log").read_text(errors="replace").splitlines()
    shard, killed_at = summary["kill"]["shard"], summary["kill"]["at"]
    replays = [line for line in server if f" {shard} " in line and "from the push log since" in line]
    pushes = sum(int(re.search(r"replayed (\d+) pushes", line).group(1)) for line in replays)
    replay_s = sum(float(re.search(r" in ([\d.]+) s", line).group(1)) for line in replays)
    spans = [(int(a), int(b)) for line in replays for a, b in re.findall(r"steps (-?\d+)-(-?\d+)", line)]
    steps = max((b - a + 1 for a, b in spans), default=0)
    serving = [stamp(line) for line in server if f"shard {shard} serving" in line and stamp(line) > killed_at]
    rebuilt = [stamp(line) for index in range(WORKERS)
               for line in (folder / "logs" / f"ps-worker{index}.log").read_text(errors="replace").splitlines()
               if "sparse part rebuilt" in line and stamp(line) > killed_at]
    step_s = WORKERS * BATCH / summary["samples_per_s"]
    return {"pushes": pushes, "replay_s": replay_s, "steps": steps, "train_s": steps * step_s,
            "served_s": min(serving) - killed_at if serving else float("nan"),
            "back_s": max(rebuilt) - killed_at if rebuilt else float("nan")}


def verdict(value: float, target: float, above: bool = True) -> str:
    return "PASS" if (value >= target if above else value <= target) else "MISSED"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="steps of each run (default 600)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each contestant for the cost (default 3)")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints (default 200)")
    args = parser.parse_args(argv)
    print(f"# The push log: ps-demo --steps {args.steps}, checkpoints every {args.checkpoint_every} steps, "
          f"{args.rounds} rounds; 1-min load average {os.getloadavg()[0]:.1f} before")
    with tempfile.TemporaryDirectory(prefix="push-log-bench-") as scratch:
        root = pathlib.Path(scratch)
        print("\n| job | with the log (median) | without (median) | ratio | target >= 0.95 | log bytes/step | "
              "shards' write ms/step |\n|---|---:|---:|---:|---|---:|---:|")
        for label, config in (("exact", None), ("staleness 2 + cache", STALE)):
            runs: Dict[bool, List[float]] = {True: [], False: []}
            written: List[float] = []
            write_ms: List[float] = []
            for number in range(args.rounds):
                for logged in ((True, False) if number % 2 == 0 else (False, True)):
                    folder = root / f"{label.split()[0]}-{number}-{'on' if logged else 'off'}"
                    summary = demo(folder, args.steps, args.checkpoint_every, logged, config)
                    runs[logged].append(summary["samples_per_s"])
                    if logged:
                        size, seconds = appended(folder)
                        written.append(size / args.steps)
                        write_ms.append(1e3 * seconds / args.steps)
                    progress(f"  {label}, round {number + 1}, log {'on' if logged else 'off'}: "
                             f"{summary['samples_per_s']:,.0f} samples/s")
            on, off = statistics.median(runs[True]), statistics.median(runs[False])
            print(f"| {label} | {on:,.0f} | {off:,.0f} | {on / off:.3f} | {verdict(on / off, 0.95)} | "
                  f"{statistics.median(written) / 1e3:,.0f} KB | {statistics.median(write_ms):.3f} |", flush=True)

        kill_at = args.checkpoint_every + args.checkpoint_every // 2
        print(f"\n## A shard SIGKILLed at step {kill_at} (checkpoints at every {args.checkpoint_every})\n\n"
              "| push log | steps lost | pushes replayed | replay s | training of those steps s | replay faster | "
              "kill -> training again s | shard serving again s | heartbeat + restore + replay s |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---|")
        victim = None
        for logged in (True, False):  # the same shard both times
            folder = root / f"killed-{'on' if logged else 'off'}"
            summary = demo(folder, args.steps, args.checkpoint_every, logged, kill_at=kill_at, victim=victim)
            victim = summary["kill"]["shard"]
            found = recovery(folder, summary)
            faster = found["train_s"] / found["replay_s"] if found["replay_s"] > 0 else float("inf")
            bound = HEARTBEAT_TIMEOUT_S + found["served_s"] + found["replay_s"]
            print(f"| {'on' if logged else 'off'} | {summary['sparse_steps_lost']} (target 0: "
                  f"{verdict(-summary['sparse_steps_lost'], 0)}) | {found['pushes']} | {found['replay_s']:.2f} | "
                  f"{found['train_s']:.2f} | {faster:.0f}x "
                  f"({verdict(faster, 10) if logged else '-'}) | {found['back_s']:.1f} | {found['served_s']:.1f} | "
                  f"{bound:.1f} ({verdict(found['back_s'], bound, above=False)}) |", flush=True)
    print(f"\n1-min load average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
