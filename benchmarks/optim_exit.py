"""A TorchScript exit plan, measured: one QHM step through TorchScript, eager PyTorch and ``torch.compile``.

Why
    Shards run ``FunctionalQHM`` compiled by TorchScript so that an RPC thread applies a step without holding
    the GIL, and torch marks TorchScript as no longer developed.  This prints what leaving it would cost.

What it measures (one run, contestants interleaved round-robin, medians; CPU, ``--threads`` intra-op)
    (a) dense: a QHM step over ``--tensors`` tensors of ``--size`` float32 (8 x 2,097,152);
    (b) row-sparse: a step on ``--touched`` (1,000) distinct random rows of a ``--rows`` x 16 table
        (10,000,000 x 16), as a shard's push applies one (rows selected, updated, written back);
    for three ways of running the same update:

    * ``torchscript``: ``ScriptedOptimizer(FunctionalQHM)`` (dense) / the scripted row step (what shards run);
    * ``eager``: the same ``FunctionalQHM`` class uncompiled (plain PyTorch: ``_foreach_`` and fused kernels
      called from Python);
    * ``compiled``: ``torch.compile`` of a plain QHM step function (inductor's C++ loops on CPU), its first
      call (the compile) timed apart.

    (c) concurrency: ``--workers`` (4) threads each applying row-sparse steps to a table of its own, as a
        shard's RPC threads do: updates per second of each way with 1 thread and with all of them.  A way
        that holds the GIL while it computes gains nothing from more threads.

    Every way is checked against the others first (the same parameters after 3 steps, to 1e-5).

How to run
    ``.venv/bin/python benchmarks/optim_exit.py [--quick]``; markdown tables on stdout.
"""

import argparse
import statistics
import sys
import threading
import time
import warnings
from typing import Callable, Dict, List

import torch
from torch import Tensor

from paramserver.optim.functional_qhm import FunctionalQHM
from paramserver.optim.scripted import ScriptedOptimizer

LR, MOMENTUM, NU = 0.01, 0.9, 0.7


def qhm_step(params: List[Tensor], grads: List[Tensor], buffers: List[Tensor]) -> None:
    """QHM (the reference's order of operations), the function ``torch.compile`` compiles."""
    for param, grad, buffer in zip(params, grads, buffers):
        buffer.mul_(MOMENTUM).add_(grad, alpha=1.0 - MOMENTUM)
        param.add_(buffer, alpha=-LR * NU).add_(grad, alpha=-LR * (1.0 - NU))


def qhm_rows(table: Tensor, buffer: Tensor, rows: Tensor, values: Tensor) -> None:
    """A row-sparse QHM step: rows gathered, updated, written back (a shard's push, in plain PyTorch)."""
    param_rows, buffer_rows = table.index_select(0, rows), buffer.index_select(0, rows)
    buffer_rows.mul_(0.9).add_(values, alpha=0.1)  # MOMENTUM (TorchScript takes no module constants here)
    param_rows.add_(buffer_rows, alpha=-0.01 * 0.7).add_(values, alpha=-0.01 * 0.3)  # LR, NU
    table.index_copy_(0, rows, param_rows)
    buffer.index_copy_(0, rows, buffer_rows)


def ways_dense(params: List[Tensor]) -> Dict[str, Callable[[List[Tensor]], None]]:
    """Each way's dense step over its own copy of ``params``."""
    scripted = ScriptedOptimizer(FunctionalQHM, [p.clone() for p in params], lr=LR, momentum=MOMENTUM, nu=NU)
    eager = FunctionalQHM([p.clone() for p in params], lr=LR, momentum=MOMENTUM, nu=NU)
    compiled_params = [p.clone() for p in params]
    compiled_buffers = [torch.zeros_like(p) for p in params]
    compiled = torch.compile(qhm_step, dynamic=False)
    return {"torchscript": scripted.step, "eager": eager.step,
            "compiled": lambda grads: compiled(compiled_params, grads, compiled_buffers)}, \
        {"torchscript": scripted, "eager": eager, "compiled": compiled_params}


def ways_rows(table: Tensor) -> Dict[str, Callable[[Tensor, Tensor], None]]:
    """Each way's row step on its own copy of ``table``."""
    scripted_table, eager_table, compiled_table = table.clone(), table.clone(), table.clone()
    scripted = torch.jit.script(qhm_rows)
    compiled = torch.compile(qhm_rows, dynamic=True)
    buffers = {name: torch.zeros_like(table) for name in ("torchscript", "eager", "compiled")}
    return {"torchscript": lambda rows, values: scripted(scripted_table, buffers["torchscript"], rows, values),
            "eager": lambda rows, values: qhm_rows(eager_table, buffers["eager"], rows, values),
            "compiled": lambda rows, values: compiled(compiled_table, buffers["compiled"], rows, values)}, \
        {"torchscript": scripted_table, "eager": eager_table, "compiled": compiled_table}


def interleaved(ways: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, float]:
    samples: Dict[str, List[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def first_call(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def threaded_rate(step: Callable[[int], None], workers: int, seconds: float) -> float:
    """Steps per second over ``workers`` threads, each calling ``step(its index)`` for ``seconds``."""
    counts = [0] * workers
    stop = threading.Event()

    def run(index: int) -> None:
        while not stop.is_set():
            step(index)
            counts[index] += 1
    threads = [threading.Thread(target=run, args=(index,)) for index in range(workers)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    return sum(counts) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, few rounds")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--size", type=int, default=2_097_152)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--touched", type=int, default=1_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, as shards run)")
    args = parser.parse_args()
    if args.quick:
        args.size, args.rows, args.rounds = 262_144, 1_000_000, 5
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    generator = torch.Generator().manual_seed(0)

    # (a) dense
    params = [torch.randn(args.size, generator=generator) for _ in range(args.tensors)]
    grads = [torch.randn(args.size, generator=generator) * 0.01 for _ in range(args.tensors)]
    dense, dense_state = ways_dense(params)
    compile_dense = first_call(lambda: dense["compiled"](grads))
    for name in ("torchscript", "eager"):
        dense[name](grads)
    for _ in range(2):
        for step in dense.values():
            step(grads)
    reference = dense_state["compiled"]
    for name in ("torchscript", "eager"):
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(dense_state[name].params, reference)), name
    dense_times = interleaved({name: (lambda step=step: step(grads)) for name, step in dense.items()}, args.rounds)

    # (b) row-sparse
    table = torch.randn(args.rows, 16, generator=generator) * 0.01
    rows_ways, tables = ways_rows(table)

    def batch():
        rows = torch.randperm(args.rows, generator=generator)[:args.touched].sort().values
        return rows, torch.randn(args.touched, 16, generator=generator) * 0.01
    rows, values = batch()
    compile_rows = first_call(lambda: rows_ways["compiled"](rows, values))
    for name in ("torchscript", "eager"):
        rows_ways[name](rows, values)
    for _ in range(2):
        rows, values = batch()
        for step in rows_ways.values():
            step(rows, values)
    for name in ("torchscript", "eager"):
        assert torch.allclose(tables[name], tables["compiled"], atol=1e-5), name
    batches = [batch() for _ in range(args.rounds)]
    row_samples: Dict[str, List[float]] = {name: [] for name in rows_ways}
    for rows, values in batches:
        for name, step in rows_ways.items():
            started = time.perf_counter()
            step(rows, values)
            row_samples[name].append(time.perf_counter() - started)
    row_times = {name: statistics.median(samples) for name, samples in row_samples.items()}

    # (c) concurrency: each thread its own table (10% of the rows each), row steps
    small = max(args.rows // 10, args.touched * 4)
    per_thread = [ways_rows(torch.randn(small, 16, generator=generator) * 0.01)[0] for _ in range(args.workers)]
    thread_batches = [(torch.randperm(small, generator=generator)[:args.touched].sort().values,
                       torch.randn(args.touched, 16, generator=generator) * 0.01) for _ in range(args.workers)]
    for ways in per_thread:  # compiled once per function object: warm every thread's
        for index, step in enumerate(ways.values()):
            step(*thread_batches[0])
    rates = {}
    for name in ("torchscript", "eager", "compiled"):
        one = threaded_rate(lambda index: per_thread[0][name](*thread_batches[0]), 1, 2.0)
        many = threaded_rate(lambda index: per_thread[index][name](*thread_batches[index]), args.workers, 2.0)
        rates[name] = (one, many)

    numel = args.tensors * args.size
    print(f"\nQHM step, three ways (CPU, {args.threads} intra-op thread(s), medians of {args.rounds})\n")
    print("| way | (a) dense ms ({:,} elements) | (b) row-sparse ms ({:,} of {:,} rows) | (c) row steps/s, 1 thread "
          "| (c) row steps/s, {} threads | compile s (a) / (b) |".format(numel, args.touched, args.rows, args.workers))
    print("|---|---:|---:|---:|---:|---|")
    for name in ("torchscript", "eager", "compiled"):
        compile_text = f"{compile_dense:.1f} / {compile_rows:.1f}" if name == "compiled" else "-"
        print(f"| {name} | {dense_times[name] * 1e3:.2f} | {row_times[name] * 1e3:.3f} | {rates[name][0]:,.0f} | "
              f"{rates[name][1]:,.0f} | {compile_text} |")
    best = min(dense_times, key=dense_times.get)
    print(f"\nfastest dense: {best}; compiled vs torchscript: dense {dense_times['torchscript'] / dense_times['compiled']:.2f}x, "
          f"row-sparse {row_times['torchscript'] / row_times['compiled']:.2f}x, "
          f"{args.workers} threads {rates['compiled'][1] / rates['torchscript'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
