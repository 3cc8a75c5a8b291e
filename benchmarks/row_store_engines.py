"""The row store's engines on one workload: how fast each reads a step's misses and writes its evictions.

What it measures
    Each engine (``RocksRows``: RocksDB through rocksdict, as ``rocks`` and as ``rocks_estimated_rows``
    with ``exact_rows=False``: puts read nothing to count the rows; ``RowLog``: our log-structured engine,
    where it imports) on the same workload, for two records: 36 bytes (a float16 row of 16 values and row-wise
    Adagrad's float32 state) and 132 bytes (a float32 row of 32 values and the same state).

    * **load**: ``--rows`` ids (default 4M) put in batches of 16,384, as a shard's evictions fill its
      store; rows/s.
    * **steps**: ``--steps`` steps of a Zipf(1.05) id stream over the ``--rows`` ids (ranks shuffled over the
      ids, as hashed ids are); the ``--memory-fraction`` hottest ranks are the shard's memory, so a step's
      misses are ``--batch`` distinct ids drawn from the rest (the cold part) and read with one ``get``;
      then a batch of evictions of the same size (a second draw from the cold part, every id held: its
      record replaced) is written with one ``put``.  Read rows/s, write rows/s (over the time in ``get``
      and in ``put``), and each step's milliseconds, p50 and p99.
    * after: the bytes of the engine's folder (``stats()["disk_bytes"]``, after ``flush``) and the resident
      memory the process gained from before the engine opened to the end (``/proc/self/status`` VmRSS;
      the ids and records the workload holds are made before); where the engine says, its own figures.

    Every engine opens with ``direct_io=True``: reads and writes bypass the page cache, so neither is
    flattered by the machine's free memory.  Each engine and record size runs in a fresh process of its
    own, one after another.  Ratios are against the faster engine of the same run.  The rule this informs:
    keep the faster, or the simpler within 10% of it.

How to run
    ``.venv/bin/python benchmarks/row_store_engines.py [--rows 4000000] [--steps 300] [--batch 2000]
    [--memory-fraction 0.1] [--read-threads 8] [--records 36,132] [--engines rocks,row_log] [--dir PATH]``;
    progress on stderr, markdown tables on stdout.  The folder (default: a temporary one under ``--dir``,
    else the system's) needs about 2.5x the records' bytes; it is removed after each run.  The figures
    depend on the disk and on the cores: on a machine shared with other work, read them as ratios.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder's helpers
from process_cpu import read_rss  # noqa: E402

#: The records measured: bytes, and what they hold.
RECORDS = {36: "float16 x 16 + float32 state", 132: "float32 x 32 + float32 state"}
LOAD_BATCH = 16_384
ZIPF_EXPONENT = 1.05


def progress(message: str) -> None:
    print(f"[row_store_engines] {message}", file=sys.stderr, flush=True)


def engine_classes() -> Dict[str, type]:
    from paramserver.shards.server.row_store.rocks import RocksRows
    found = {"rocks": RocksRows, "rocks_estimated_rows": functools.partial(RocksRows, exact_rows=False)}
    try:
        from paramserver.shards.server.row_store.row_log import RowLog
    except ImportError as error:
        progress(f"no RowLog ({error}): RocksRows alone")
    else:
        found["row_log"] = RowLog
    return found


def cold_draws(rng: np.random.Generator, rows: int, hot: int, batch: int, count: int) -> List[np.ndarray]:
    """``count`` batches of ``batch`` distinct ids, each drawn Zipf(1.05) over the ranks ``hot..rows`` (the
    cold part), ranks mapped to ids by one random permutation."""
    weights = np.arange(hot + 1, rows + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    cumulative = np.cumsum(weights)
    cumulative /= cumulative[-1]
    rank_to_id = rng.permutation(rows)
    batches = []
    for _ in range(count):
        drawn = np.empty(0, dtype=np.int64)
        while drawn.size < batch:
            more = hot + np.searchsorted(cumulative, rng.random(batch * 2), side="right")
            drawn = np.unique(np.concatenate([drawn, np.minimum(more, rows - 1)]))
        batches.append(rank_to_id[rng.permutation(drawn)[:batch]].astype(np.int64))
    return batches


def run_one(engine_name: str, record_bytes: int, args) -> Dict:
    """In a fresh process: the workload on one engine; its figures (printed as JSON)."""
    engine_class = engine_classes()[engine_name]
    rng = np.random.default_rng(args.seed)
    hot = int(args.rows * args.memory_fraction)
    misses = cold_draws(rng, args.rows, hot, args.batch, args.steps)
    evictions = cold_draws(rng, args.rows, hot, args.batch, args.steps)
    block = torch.from_numpy(rng.integers(0, 256, (LOAD_BATCH, record_bytes), dtype=np.uint8))
    out = torch.empty(args.batch, record_bytes, dtype=torch.uint8)
    folder = tempfile.mkdtemp(prefix=f"row_store_{engine_name}_", dir=args.dir)
    before = read_rss(os.getpid())
    engine = engine_class(os.path.join(folder, "rows"), record_bytes, direct_io=True, read_threads=args.read_threads)
    try:
        started = time.perf_counter()
        for start in range(0, args.rows, LOAD_BATCH):
            ids = torch.arange(start, min(start + LOAD_BATCH, args.rows), dtype=torch.int64)
            engine.put(ids, block[:ids.numel()])
        engine.flush()
        load_s = time.perf_counter() - started
        progress(f"{engine_name} {record_bytes} B: loaded {args.rows:,} rows in {load_s:.1f} s")
        read_s = write_s = 0.0
        steps_ms = []
        for step in range(args.steps):
            ids = torch.from_numpy(misses[step])
            t0 = time.perf_counter()
            found = engine.get(ids, out)
            t1 = time.perf_counter()
            engine.put(torch.from_numpy(evictions[step]), block[step % 7:step % 7 + args.batch])
            t2 = time.perf_counter()
            if not bool(found.all()):
                raise RuntimeError(f"{engine_name}: step {step} missed ids it was given")
            read_s += t1 - t0
            write_s += t2 - t1
            steps_ms.append((t2 - t0) * 1e3)
        engine.flush()
        stats = engine.stats()
        figures = {
            "load_rows_s": args.rows / load_s, "read_rows_s": args.steps * args.batch / read_s,
            "write_rows_s": args.steps * args.batch / write_s, "step_ms_mean": statistics.fmean(steps_ms),
            "step_ms_p50": float(np.percentile(steps_ms, 50)), "step_ms_p99": float(np.percentile(steps_ms, 99)),
            "disk_bytes": stats["disk_bytes"], "rows": stats["rows"], "compactions": stats["compactions"],
            "rss_growth_bytes": read_rss(os.getpid()) - before, "direct_io": bool(getattr(engine, "direct_io", True)),
        }
        if hasattr(engine, "memory_bytes"):
            figures["engine_memory"] = engine.memory_bytes()
        return figures
    finally:
        engine.close(remove=True)
        os.rmdir(folder)


def measure(engine_name: str, record_bytes: int, args) -> Dict:
    progress(f"{engine_name}, {record_bytes}-byte records, in a fresh process")
    command = [sys.executable, os.path.abspath(__file__), "--child", engine_name, "--records", str(record_bytes),
               "--rows", str(args.rows), "--steps", str(args.steps), "--batch", str(args.batch),
               "--memory-fraction", str(args.memory_fraction), "--read-threads", str(args.read_threads),
               "--seed", str(args.seed)] + (["--dir", args.dir] if args.dir else [])
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the {engine_name} run exited {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(record_bytes: int, results: Dict[str, Dict]) -> None:
    fastest_read = max(figures["read_rows_s"] for figures in results.values())
    fastest_write = max(figures["write_rows_s"] for figures in results.values())
    fastest_load = max(figures["load_rows_s"] for figures in results.values())
    fastest_step = min(figures["step_ms_mean"] for figures in results.values())
    print(f"\n## {record_bytes}-byte records ({RECORDS.get(record_bytes, 'as given')})\n")
    print("| engine | load rows/s (ratio) | read rows/s (ratio) | write rows/s (ratio) | step ms mean (ratio) "
          "| p50 | p99 | disk MB | RSS growth MB | engine's memory MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, f in results.items():
        engine_memory = f.get("engine_memory")
        own = f"{sum(engine_memory.values()) / 2**20:.1f}" if engine_memory else "-"
        print(f"| {name}{'' if f['direct_io'] else ' (buffered)'} | {f['load_rows_s']:,.0f} "
              f"({f['load_rows_s'] / fastest_load:.2f}) | {f['read_rows_s']:,.0f} "
              f"({f['read_rows_s'] / fastest_read:.2f}) "
              f"| {f['write_rows_s']:,.0f} ({f['write_rows_s'] / fastest_write:.2f}) | {f['step_ms_mean']:.2f} "
              f"({f['step_ms_mean'] / fastest_step:.2f}) | {f['step_ms_p50']:.2f} | {f['step_ms_p99']:.2f} "
              f"| {f['disk_bytes'] / 2**20:,.1f} | {f['rss_growth_bytes'] / 2**20:,.1f} | {own} |")
    if len(results) > 1:
        ranked = sorted(results, key=lambda name: results[name]["step_ms_mean"])
        others = [f"{name} {results[name]['step_ms_mean'] / fastest_step:.2f}x "
                  f"({'within' if results[name]['step_ms_mean'] <= 1.10 * fastest_step else 'beyond'} 10%)"
                  for name in ranked[1:]]
        print(f"\nFastest by a step's mean time: {ranked[0]}; {', '.join(others)}.")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=2000, help="misses a step, and evictions a step")
    parser.add_argument("--memory-fraction", type=float, default=0.1, help="the hottest ranks' share, in memory")
    parser.add_argument("--read-threads", type=int, default=8)
    parser.add_argument("--records", default="36,132", help="record sizes in bytes, comma-separated")
    parser.add_argument("--engines", default="", help="engines, comma-separated (default: every one that imports)")
    parser.add_argument("--dir", default=None, help="where the engines' folders go (default: the system's temp)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch > LOAD_BATCH - 7 or args.batch > args.rows * (1 - args.memory_fraction) / 2:
        parser.error("--batch must be below 16,377 and well below the cold part's ids")
    if args.child:
        print(json.dumps(run_one(args.child, int(args.records), args)))
        return
    names = args.engines.split(",") if args.engines else list(engine_classes())
    sizes = [int(size) for size in args.records.split(",")]
    print(f"# Row store engines: {args.rows:,} rows loaded in batches of {LOAD_BATCH:,}, then {args.steps} steps "
          f"of {args.batch:,} misses (Zipf {ZIPF_EXPONENT} over the coldest {1 - args.memory_fraction:.0%} of "
          f"the ids) and {args.batch:,} evictions; direct I/O (the page cache flatters neither); "
          f"read_threads={args.read_threads}; {os.cpu_count()} cores, 1-min load average "
          f"{os.getloadavg()[0]:.1f} before (other work on these cores slows the engines)")
    for record_bytes in sizes:
        report(record_bytes, {name: measure(name, record_bytes, args) for name in names})
    print(f"\n1-min load average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
