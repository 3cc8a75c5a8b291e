"""Does online training keep up?  Lag from a file landing to its training, and memory, over minutes.

What it measures
    The default job (``paramserver/jobs/ctr.py``) on Criteo-format files it follows as they land (``"follow": true``),
    in this process (``JobContext.local``: the process is its own shard and a trainer group of one, one
    intra-op thread), on dynamic tables with ``ttl_steps`` so that a stream of new ids keeps them bounded.

    1. Throughput: the job on ``--warmup-files`` files already there, samples/s measured over its steps
       after the first ``--warmup-steps``.
    2. Online: a producer process writes a file every ``--interval`` seconds (written under a temporary name,
       then renamed, as Spark and Flink do) holding ``--load`` (80%) of the measured throughput's samples,
       for ``--minutes`` (10); the job follows the directory, listing it every ``--poll`` seconds.  A file's
       lag is the time from its rename to the moment the trainer's read-ahead takes its first batch (the
       reader's position names the file); it is trained on when the step that gets that batch computes its
       loss (``FileClock``: after the step's lookups and forward pass).  The resident memory of the
       process is sampled every second.

Targets
    In the steady state (the second half of the run), a file is being trained on within one poll interval
    plus one step (from its rename to its first batch's step), judged on the 95th percentile; and the job keeps
    up (the last file is trained on before the run ends) without growing memory (resident memory at the end
    within 10% of that at the end of the first half).  Each says PASS or BELOW; exit 0 either way.

How to run
    ``.venv/bin/python benchmarks/online.py [--minutes 10] [--plot online.png]``; progress on stderr, the
    results on stdout as a markdown table, the lag and memory over time drawn into ``--plot``.
"""

import argparse
import logging
import multiprocessing
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List, Tuple

import torch

from paramserver.runtime.context import JobContext
from paramserver.jobs import ctr
from paramserver.jobs.ctr_files import PlantedFiles

BATCH = 1024
#: Distinct file contents the producer lands in turn.
CONTENTS = 4
#: How long the producer may take to render them.
RENDER_WITHIN = 300
TTL_STEPS = 200


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def produce(directory: str, lines: int, interval: float, seconds: float, landed) -> None:
    """A producer process: lands a file of ``lines`` lines into ``directory`` every ``interval`` seconds for
    ``seconds``; puts ``"ready"`` on ``landed`` when it starts, ``(path, landed at)`` for each file
    (``time.monotonic``, the same clock in every process of this host), then ``None``.  Its files' contents are
    rendered before the clock starts (a few, used in turn), so that on these few cores the producer costs the trainer a file copy, not a generator."""
    contents = []
    for index in range(CONTENTS):
        scratch = pathlib.Path(directory) / f".render-{index}"
        PlantedFiles(seed=11).write_criteo(str(scratch), index, lines)
        contents.append(scratch.read_bytes())
        scratch.unlink()
    landed.put("ready")
    stream, next_at = 0, time.monotonic()
    until = next_at + seconds
    while time.monotonic() < until:
        name = f"part-{stream:06d}.txt"
        temporary = pathlib.Path(directory) / f".{name}.tmp"
        temporary.write_bytes(contents[stream % CONTENTS])
        temporary.rename(pathlib.Path(directory) / name)
        landed.put((str(pathlib.Path(directory) / name), time.monotonic()))
        stream += 1
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    landed.put(None)


class Watcher(threading.Thread):
    """Samples the resident memory every second; ``clock`` (a ``FileClock``) times the files."""

    def __init__(self, clock: "FileClock"):
        super().__init__(name="watcher", daemon=True)
        self.clock = clock
        self.memory: List[Tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.memory.append((time.monotonic(), rss_bytes()))


class FileClock:
    """When each file's first batch is taken by the trainer's read-ahead (``taken``: the reader's position
    names the file for the first time as it gives that batch) and when it reaches a training step
    (``trained``: the step's loss, computed after its lookups and forward pass, gets that batch)."""

    def __init__(self, reader, trainer):
        self.taken: Dict[str, float] = {}
        self.trained: Dict[str, float] = {}
        self._tags: Dict[int, Tuple[torch.Tensor, List[str]]] = {}
        batches, loss = reader._batches, trainer.loss

        def tagged(*args):
            for batch in batches(*args):
                now = time.monotonic()
                new = [path for path in _paths(reader.state_dict()) if path not in self.taken]
                if new:
                    self.taken.update(dict.fromkeys(new, now))
                    self._tags[id(batch.labels)] = (batch.labels, new)  # held: the id is not reused meanwhile
                yield batch

        def timed(logits, labels):
            tag = self._tags.pop(id(labels), None)
            if tag is not None:
                now = time.monotonic()
                for path in tag[1]:
                    self.trained.setdefault(path, now)
            return loss(logits, labels)

        reader._batches, trainer.loss = tagged, timed


def _p95(values: List[float]) -> float:
    """The 95th percentile of ``values`` (nearest rank; NaN when there are none)."""
    return sorted(values)[max(0, int(len(values) * 0.95) - 1)] if values else float("nan")


def _paths(state: Dict) -> List[str]:
    """The files a followed reader's position names (done, and the one under way)."""
    return [key.split("@")[0] for key in [*state.get("done", []), state.get("key", "")] if key]


def run_job(ctx, data: Dict, steps: int, name: str, watch: bool = False, stop_at: float = 0.0):
    trainer, source = ctr.build(ctx, batch_size=BATCH, hook="allreduce", table_name=name, data=data,
                                table_options={"ttl_steps": TTL_STEPS})
    watcher = Watcher(FileClock(source.train, trainer)) if watch else None
    if watcher is not None:
        watcher.start()
    stopper = None
    if stop_at:
        stopper = threading.Timer(max(0.0, stop_at - time.monotonic()), ctx.inbox.request_stop)
        stopper.start()
    try:
        result = trainer.fit(source.train, steps=steps, eval_every=10 ** 9, log_every=200)
    finally:
        source.close()
        if watcher is not None:
            watcher.stop.set()
            watcher.join(5)
        if stopper is not None:
            stopper.cancel()
    return result, watcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between files landing")
    parser.add_argument("--poll", type=float, default=2.0, help="the job's poll_seconds")
    parser.add_argument("--load", type=float, default=0.8, help="the producer's rate, a share of the throughput")
    parser.add_argument("--warmup-files", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--plot", default="online.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    ctx = JobContext.local()
    try:
        with tempfile.TemporaryDirectory(prefix="online-") as scratch:
            root = pathlib.Path(scratch)
            warm = root / "warm"
            warm.mkdir()
            lines = 60 * BATCH
            for index in range(args.warmup_files):
                PlantedFiles(seed=11).write_criteo(str(warm / f"part-{index:06d}.txt"), 10_000 + index, lines)
            steps = args.warmup_files * lines // BATCH - 10
            print(f"1. throughput: {steps} steps of {BATCH} on files already there", file=sys.stderr)
            # samples/s over the steps after the first log window: ctr reports the whole run's; run twice as long
            # as the warm-up window and take the difference
            short, _ = run_job(ctx, {"train": str(warm), "epochs": 1}, args.warmup_steps, "online-warm-a")
            full, _ = run_job(ctx, {"train": str(warm), "epochs": 1}, steps, "online-warm-b")
            seconds = steps * BATCH / full["samples_per_s"] - args.warmup_steps * BATCH / short["samples_per_s"]
            throughput = (steps - args.warmup_steps) * BATCH / seconds
            step_seconds = BATCH / throughput
            file_lines = int(throughput * args.load * args.interval)
            print(f"   {throughput:,.0f} samples/s ({step_seconds * 1000:.1f} ms a step); the producer lands "
                  f"{file_lines:,} lines every {args.interval:g} s ({args.load:.0%})", file=sys.stderr)

            live = root / "live"
            live.mkdir()
            spawn = multiprocessing.get_context("spawn")
            landed_queue = spawn.Queue()
            producer = spawn.Process(target=produce, name="producer",
                                     args=(str(live), file_lines, args.interval, args.minutes * 60, landed_queue))
            producer.start()
            if landed_queue.get(timeout=RENDER_WITHIN) != "ready":  # it renders its files first
                raise RuntimeError("the producer did not render its files")
            began = time.monotonic()
            until = began + args.minutes * 60
            print(f"2. online for {args.minutes:g} minutes, polling every {args.poll:g} s", file=sys.stderr)
            data = {"train": str(live), "follow": True, "poll_seconds": args.poll}
            result, watcher = run_job(ctx, data, 10 ** 9, "online-live", watch=True, stop_at=until + 3 * args.interval)
            landed: Dict[str, float] = {}
            for item in iter(lambda: landed_queue.get(timeout=args.interval + 60), None):
                landed[item[0]] = item[1]
            producer.join(args.interval + 10)
            if producer.is_alive():
                producer.kill()
                producer.join(10)
    finally:
        ctx.close()

    taken = watcher.clock.taken
    lags = [(landed - began, taken[path] - landed) for path, landed in sorted(landed.items(), key=lambda item: item[1])
            if path in taken]
    missed = len(landed) - len(lags)
    steady = [lag for at, lag in lags if at >= args.minutes * 30]
    bound = args.poll + step_seconds
    trained = watcher.clock.trained
    trained_lags = sorted((at - began, trained[path] - at) for path, at in landed.items() if path in trained)
    trained_within = [lag for at, lag in trained_lags if at >= args.minutes * 30]
    p95 = _p95(trained_within)
    half = began + args.minutes * 30
    memory_half = min((abs(at - half), rss) for at, rss in watcher.memory)[1]
    memory_end = watcher.memory[-1][1]
    growth = memory_end / memory_half - 1

    print(f"\nonline training, {args.minutes:g} minutes, a file every {args.interval:g} s at {args.load:.0%} of "
          f"{throughput:,.0f} samples/s, poll {args.poll:g} s, one process, 1 thread\n")
    print("| figure | value |")
    print("|---|---:|")
    print(f"| files landed / trained on | {len(landed)} / {len(lags)} |")
    print(f"| steps trained | {result['steps']:,} |")
    print(f"| lag to the first batch taken, steady state: median / p95 / max (s) | "
          f"{statistics.median(steady):.2f} / {_p95(steady):.2f} / "
          f"{max(steady):.2f} |")
    print(f"| trained on within (landed to its first batch's step), steady state: median / p95 / max (s) | "
          f"{statistics.median(trained_within):.2f} / {p95:.2f} / {max(trained_within):.2f} |")
    print(f"| bound: one poll + one step (s) | {bound:.2f} |")
    print(f"| resident memory at half time / end (MB) | {memory_half / 1e6:,.0f} / {memory_end / 1e6:,.0f} |")
    print(f"\ntarget: a file trained on within one poll plus one step (p95, steady state): {p95:.2f} s <= "
          f"{bound:.2f} s {'PASS' if p95 <= bound else 'BELOW'}")
    print(f"target: keeps up (every file landed trained on): {missed} missed {'PASS' if missed == 0 else 'BELOW'}")
    print(f"target: memory does not grow (end vs half time): {growth:+.1%} {'PASS' if growth <= 0.10 else 'BELOW'}")
    _plot(args.plot, lags, trained_lags, watcher.memory, began, bound)
    return 0


def _plot(path: str, lags: List[Tuple[float, float]], trained: List[Tuple[float, float]],
          memory: List[Tuple[float, int]], began: float, bound: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (lag_axis, memory_axis) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    lag_axis.plot([at / 60 for at, _ in lags], [lag for _, lag in lags], ".-", label="file landed -> first batch taken")
    lag_axis.plot([at / 60 for at, _ in trained], [lag for _, lag in trained], ".-",
                  label="file landed -> its first batch's step")
    lag_axis.axhline(bound, color="red", linestyle="--", label="one poll + one step")
    lag_axis.set_ylabel("lag (s)")
    lag_axis.legend()
    memory_axis.plot([(at - began) / 60 for at, _ in memory], [rss / 1e6 for _, rss in memory])
    memory_axis.set_ylabel("resident memory (MB)")
    memory_axis.set_xlabel("minutes")
    figure.tight_layout()
    figure.savefig(path)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
