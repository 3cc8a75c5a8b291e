"""Half-precision rows: what a table costs in memory and on the wire, and what its model loses in quality.

What it measures
    Memory: the resident memory one shard process gains by holding a 20M x 16 table (``--rows``,
    ``--dim``) with row-wise Adagrad's state (one float32 per row, made by a first push), float16 rows
    beside float32 rows; each measured in a fresh process of its own (``/proc/self/status`` VmRSS before
    the table and after its first push).
    Wire: the bytes of the rows one step's lookup brings back (a batch of the default job's shape, over
    torch RPC from a shard process, ``service.lookup`` as a trainer's collection sends it), float16 and
    bfloat16 beside float32, and the bytes of the step's push with ``push_dtype=torch.bfloat16``.
    Quality: the default CTR job (``paramserver/jobs/ctr.py``, ``ps-demo --hook allreduce``: 4 shards,
    2 workers, 1500 steps, seed 0) with ``"row_dtype"`` float32, float16 (stochastic rounding), float16
    with nearest rounding, and bfloat16; the held-out AUC of each and its gap to float32's.

How to run
    ``.venv/bin/python benchmarks/row_precision.py [--rows N] [--dim D] [--steps N] [--batch N] [--seed N]
    [--skip-quality]``; the defaults take about 6 minutes on 2 cores (four ps-demo runs; the memory
    children need about 2 GB at most).  Progress goes to stderr, results to stdout.

How to read it
    Three tables and the targets' lines: memory of float16 rows within 0.55x of float32's; lookup bytes
    per step 0.5x of float32's; the default job with float16 rows within 0.002 held-out AUC of float32
    rows.  Nearest rounding is shown beside stochastic rounding: with it small updates are lost, which is
    why tables round stochastically by default.  Exits 0 whatever the verdicts, 1 if a run failed.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # end_to_end, a sibling script

from end_to_end import ContestantFailed, run_demo  # noqa: E402

MEMORY_TARGET = 0.55
WIRE_TARGET = 0.5
AUC_GAP_TARGET = 0.002
#: The quality runs: label, the job's row_dtype and row_rounding.
QUALITY_RUNS = (("float32", "float32", "stochastic"), ("float16", "float16", "stochastic"),
                ("float16, nearest", "float16", "nearest"), ("bfloat16", "bfloat16", "stochastic"))
#: The default job's step: 1024 samples of 26 one-id features (the planted CTR data's shape).
LOOKUP_BATCH, LOOKUP_FEATURES, LOOKUP_TABLE_ROWS = 1024, 26, 100_000


def progress(message: str) -> None:
    print(f"[row_precision] {message}", file=sys.stderr, flush=True)


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_child(dtype_name: str, rows: int, dim: int) -> None:
    """In a fresh process: the resident bytes a shard's state gains by hosting the table and its optimizer's
    state (printed as JSON)."""
    from paramserver.optim import RowWiseAdagrad
    from paramserver.shards.server import ShardState
    from paramserver.shards.server.hosted import host_rows
    from paramserver.shards.server.optimizers import owner_optimizer_for
    state = ShardState()
    before = resident_bytes()
    table = host_rows(state, "bench.t[0:%d]" % rows, rows, dim, getattr(torch, dtype_name), 0, 0, shared=True,
                      init_std=0.01)
    optimizer = owner_optimizer_for(state, RowWiseAdagrad, [table], [0], (), dict(lr=0.1))
    ids = torch.arange(0, rows, max(1, rows // 1024))
    optimizer.apply_rows([0], [ids], [torch.ones(ids.numel(), dim)], "bench")  # makes the state: 1 float per row
    print(json.dumps({"bytes": resident_bytes() - before, "table_bytes": table.numel() * table.element_size(),
                      "state_bytes": rows * 4}))


def measure_memory(args) -> Dict[str, Dict]:
    results = {}
    for dtype_name in ("float32", "float16"):
        progress(f"memory: {args.rows:,} x {args.dim} {dtype_name} rows with row-wise Adagrad, in a fresh process")
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", dtype_name,
                               "--rows", str(args.rows), "--dim", str(args.dim)],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise ContestantFailed(f"the {dtype_name} memory child exited {done.returncode}: {done.stderr[-2000:]}")
        results[dtype_name] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def wire_trainer(out: str) -> None:
    """In a trainer of a local cluster: the bytes of a step's lookup reply per row type, and of its push with
    float32 and bfloat16 gradients."""
    import torch.distributed.rpc as rpc
    from paramserver.shards.client.embedding import ShardedEmbeddingBag
    from paramserver.shards.server import service
    from paramserver.shards import wire
    ids = torch.randint(0, LOOKUP_TABLE_ROWS, (LOOKUP_BATCH * LOOKUP_FEATURES,)).unique()
    figures = {"distinct_ids": ids.numel()}
    for dtype_name in ("float32", "float16", "bfloat16"):
        table = ShardedEmbeddingBag(LOOKUP_TABLE_ROWS, 16, shards=["shard0"], name=f"wire-{dtype_name}",
                                    dtype=getattr(torch, dtype_name), shared=True)
        incarnation, handles = rpc.rpc_sync("shard0", service.table_handles, args=(table.remote_parameters(),))
        reply = rpc.rpc_sync("shard0", service.lookup, args=(incarnation, handles, wire.pack_ids([ids]),
                                                             [ids.numel()], -1))
        figures[dtype_name] = reply.numel() * reply.element_size()
    gradients = torch.randn(ids.numel(), 16)
    figures["push_float32"] = gradients.numel() * gradients.element_size()
    pushed = gradients.to(torch.bfloat16)
    figures["push_bfloat16"] = pushed.numel() * pushed.element_size()
    pathlib.Path(out).write_text(json.dumps(figures))


def measure_wire(folder: pathlib.Path) -> Dict:
    from paramserver.shards.local import run_local_cluster
    progress("wire: one step's lookup reply from a shard process, per row type")
    out = folder / "wire.json"
    run_local_cluster([(wire_trainer, (str(out),))], num_shards=1)
    return json.loads(out.read_text())


def measure_quality(args, folder: pathlib.Path) -> Dict[str, Optional[Dict]]:
    runs: Dict[str, Optional[Dict]] = {}
    for label, dtype_name, rounding in QUALITY_RUNS:
        progress(f"quality: the default job with {label} rows, {args.steps} steps")
        run_folder = folder / label.replace(", ", "-")
        run_folder.mkdir()
        try:
            runs[label] = run_demo(run_folder, args.steps, args.batch, 100, 900.0, extra_config={
                "seed": args.seed, "row_dtype": dtype_name, "row_rounding": rounding})
            progress(f"  AUC {runs[label]['auc']:.4f}, {runs[label]['samples_per_s']:,.0f} samples/s")
        except ContestantFailed as error:
            progress(str(error))
            runs[label] = None
    return runs


def verdict(passed: bool) -> str:
    return "PASS" if passed else "BELOW"


def report(memory: Dict, wire_figures: Dict, quality: Dict[str, Optional[Dict]], args) -> List[str]:
    lines = []
    print(f"# Half-precision rows: torch {torch.__version__}, {os.cpu_count()} cores\n")
    print(f"| {args.rows:,} x {args.dim} rows, row-wise Adagrad | resident MB | rows MB | state MB |")
    print("|---|---:|---:|---:|")
    for dtype_name, figures in memory.items():
        print(f"| {dtype_name} | {figures['bytes'] / 1e6:,.0f} | {figures['table_bytes'] / 1e6:,.0f} "
              f"| {figures['state_bytes'] / 1e6:,.0f} |")
    ratio = memory["float16"]["bytes"] / memory["float32"]["bytes"]
    lines.append(f"memory: float16 rows / float32 rows = {ratio:.3f}x (target <= {MEMORY_TARGET}x) "
                 f"{verdict(ratio <= MEMORY_TARGET)}")
    print(f"\n| one step's lookup ({wire_figures['distinct_ids']:,} distinct rows of 16) | reply bytes | "
          f"vs float32 |")
    print("|---|---:|---:|")
    for dtype_name in ("float32", "float16", "bfloat16"):
        print(f"| {dtype_name} rows | {wire_figures[dtype_name]:,} | "
              f"{wire_figures[dtype_name] / wire_figures['float32']:.3f}x |")
    print(f"| push, float32 gradients | {wire_figures['push_float32']:,} | |")
    print(f"| push, bfloat16 gradients | {wire_figures['push_bfloat16']:,} | "
          f"{wire_figures['push_bfloat16'] / wire_figures['push_float32']:.3f}x |")
    wire_ratio = wire_figures["float16"] / wire_figures["float32"]
    lines.append(f"wire: lookup bytes per step, float16 / float32 = {wire_ratio:.3f}x (target {WIRE_TARGET}x) "
                 f"{verdict(wire_ratio <= WIRE_TARGET)}")
    if quality:
        base = quality.get("float32")
        print(f"\n| the default job ({args.steps} steps x {args.batch} x 2 workers) | held-out AUC "
              f"| gap vs float32 | samples/s |")
        print("|---|---:|---:|---:|")
        for label, summary in quality.items():
            if summary is None:
                print(f"| {label} rows | failed | | |")
                continue
            gap = summary["auc"] - base["auc"] if base else float("nan")
            print(f"| {label} rows | {summary['auc']:.4f} | {gap:+.4f} | {summary['samples_per_s']:,.0f} |")
        half = quality.get("float16")
        if base and half:
            gap = half["auc"] - base["auc"]
            lines.append(f"quality: AUC with float16 rows minus float32 rows = {gap:+.4f} (target abs <= "
                         f"{AUC_GAP_TARGET}) {verdict(abs(gap) <= AUC_GAP_TARGET)}")
    print()
    for line in lines:
        print(line)
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Half-precision rows: memory, lookup bytes and held-out quality "
                                                 "against float32 rows.")
    parser.add_argument("--rows", type=int, default=20_000_000, help="rows of the memory table (default 20M)")
    parser.add_argument("--dim", type=int, default=16, help="its row width (default 16)")
    parser.add_argument("--steps", type=int, default=1500, help="the quality runs' steps (default 1500, the job's)")
    parser.add_argument("--batch", type=int, default=1024, help="samples per worker per step (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="the job's seed, the same for every run (default 0)")
    parser.add_argument("--skip-quality", action="store_true", help="memory and wire only (seconds)")
    parser.add_argument("--memory-child", metavar="DTYPE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.rows, args.dim)
        return 0
    if min(args.rows, args.dim, args.steps, args.batch) < 1:
        parser.error("--rows, --dim, --steps and --batch must be at least 1")
    with tempfile.TemporaryDirectory(prefix="row-precision-") as folder:
        memory = measure_memory(args)
        wire_figures = measure_wire(pathlib.Path(folder))
        quality = {} if args.skip_quality else measure_quality(args, pathlib.Path(folder))
    report(memory, wire_figures, quality, args)
    return 1 if any(summary is None for summary in quality.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
