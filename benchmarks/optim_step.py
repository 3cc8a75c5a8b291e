"""How fast is one ``FunctionalQHM`` step?  A side-by-side CPU benchmark.

What it measures
    Nanoseconds per parameter element of one optimizer step for:

    * ``FunctionalQHM``, compiled through ``ScriptedOptimizer`` (how the
      parameter servers run it: the step executes in the TorchScript
      interpreter);
    * the reference ``qhoptim.pyt.QHM`` (a ``torch.optim.Optimizer``);
    * the memory floor: a QHM step must read parameter, gradient and momentum
      buffer and write parameter and buffer, 20 bytes per float32 element.
      The floor is that traffic at the copy bandwidth (``dst.copy_(src)``, 8
      bytes per element) measured in the same run on the same amount of data.

    Cases:

    (a) few large tensors: 8 x 2,097,152 float32 (16.8M elements);
    (b) many small tensors: 16,384 x 256 float32 (4.2M elements), where
        per-tensor overhead dominates;
    (c) an embedding table of 10,000,000 x 16 float32 (640 MB per tensor):
        a row-sparse step (COO gradient touching 1,000 distinct random rows,
        as ``nn.Embedding(sparse=True)`` produces) against a dense step of the
        whole table, both through the same ``FunctionalQHM``; the reference's
        dense step on the table is timed too.

How to run
    ``make bench``, or ``.venv/bin/python benchmarks/optim_step.py``.
    Options: ``--quick`` (a smoke run: fewer rounds, a 1M-row table),
    ``--rounds N`` (timed rounds for (a) and (b); the table case uses a third
    of them, at least 3), ``--threads N`` (``torch.set_num_threads``; the
    default leaves torch's choice).  Progress goes to stderr; the results go
    to stdout as markdown tables that can be pasted into docs/benchmarks.md.

How to read it
    Contestants of a case run round-robin (A, B, copy, A, B, copy, ...) after
    a warm-up, so drifting machine load hits them all alike.  Optimizer times
    are the median over the rounds and ratios are ratios of medians; the copy
    bandwidth is the best round (the floor is what the memory system can do).
    "speedup vs qhoptim" is qhoptim time / FunctionalQHM time, "% of floor
    speed" is floor time / FunctionalQHM time (100% = memory bound).  Each
    target line says PASS or BELOW; the script always exits 0.  Timings on a
    shared machine are noisy: compare runs, not digits.
"""

import argparse
import gc
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
from qhoptim.pyt import QHM

from paramserver.optim.functional_qhm import FunctionalQHM
from paramserver.optim.scripted import ScriptedOptimizer

# Small enough that parameters stay finite over hundreds of steps.
LR, MOMENTUM, NU = 1e-3, 0.9, 0.7
WARMUP_STEPS = 3
QHM_BYTES_PER_ELEMENT = 20  # read param, grad, buffer; write param, buffer
COPY_BYTES_PER_ELEMENT = 8  # read src, write dst

TARGET_SPEEDUP_FEW_LARGE = 1.8
TARGET_SPEEDUP_MANY_SMALL = 4.0
TARGET_SPARSE_VS_DENSE = 100.0


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

@dataclass
class Contestant:
    """One thing to time; a sample runs ``step`` ``calls`` times (for very short steps)."""

    name: str
    step: Callable[[], None]
    calls: int = 1


def time_interleaved(contestants: Sequence[Contestant], rounds: int) -> Dict[str, List[float]]:
    """Seconds per call of each contestant, one sample per round, round-robin after a warm-up."""
    for contestant in contestants:
        for _ in range(WARMUP_STEPS):
            contestant.step()
    samples: Dict[str, List[float]] = {c.name: [] for c in contestants}
    for _ in range(rounds):
        for contestant in contestants:
            start = time.perf_counter_ns()
            for _ in range(contestant.calls):
                contestant.step()
            elapsed = time.perf_counter_ns() - start
            samples[contestant.name].append(elapsed * 1e-9 / contestant.calls)
    return samples


def copy_contestant(numel: int) -> Contestant:
    """``dst.copy_(src)`` over two flat float32 tensors of ``numel`` elements."""
    src = torch.randn(numel)
    dst = torch.empty(numel)
    return Contestant("copy", lambda: dst.copy_(src))


def floor_seconds(copy_samples: List[float]) -> float:
    """Time of a QHM step's memory traffic at the best copy bandwidth of the run."""
    return min(copy_samples) * QHM_BYTES_PER_ELEMENT / COPY_BYTES_PER_ELEMENT


def copy_gbps(copy_samples: List[float], numel: int) -> float:
    return numel * COPY_BYTES_PER_ELEMENT / min(copy_samples) / 1e9


# --------------------------------------------------------------------------
# Contestants
# --------------------------------------------------------------------------

def functional_qhm(params: List[torch.Tensor]) -> ScriptedOptimizer:
    return ScriptedOptimizer(FunctionalQHM, params, lr=LR, momentum=MOMENTUM, nu=NU)


def reference_qhm(params: List[torch.Tensor], grads: List[torch.Tensor]) -> QHM:
    """qhoptim over ``params`` with ``p.grad`` set once (it only writes grads under weight decay)."""
    for param, grad in zip(params, grads):
        param.grad = grad
    return QHM(params, lr=LR, momentum=MOMENTUM, nu=NU)


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------

@dataclass
class DenseResult:
    label: str
    numel: int
    ours_s: float
    reference_s: float
    floor_s: float
    copy_gbps: float
    target: float


def dense_case(label: str, count: int, size: int, rounds: int, target: float) -> DenseResult:
    """Case (a)/(b): ``count`` float32 tensors of ``size`` elements, dense gradients."""
    numel = count * size
    grads = [torch.randn(size) for _ in range(count)]
    ours = functional_qhm([torch.randn(size) for _ in range(count)])
    reference = reference_qhm([torch.randn(size) for _ in range(count)], grads)
    samples = time_interleaved([
        Contestant("ours", lambda: ours.step(grads)),
        Contestant("reference", reference.step),
        copy_contestant(numel),  # one flat tensor, whatever the layout of the case
    ], rounds)
    return DenseResult(
        label=label, numel=numel,
        ours_s=statistics.median(samples["ours"]),
        reference_s=statistics.median(samples["reference"]),
        floor_s=floor_seconds(samples["copy"]),
        copy_gbps=copy_gbps(samples["copy"], numel),
        target=target)


@dataclass
class TableResult:
    rows: int
    dim: int
    touched: int
    sparse_s: float
    dense_s: float
    reference_dense_s: Optional[float]
    floor_s: float
    copy_gbps: float


def table_case(rows: int, dim: int, touched: int, rounds: int, with_reference: bool) -> TableResult:
    """Case (c): a ``rows x dim`` table, a sparse step of ``touched`` rows vs a dense step."""
    numel = rows * dim
    table = torch.randn(rows, dim)
    dense_grad = torch.randn(rows, dim)
    row_ids = torch.randperm(rows)[:touched]
    # Uncoalesced, as nn.Embedding(sparse=True) hands it over; validated once here.
    sparse_grad = torch.sparse_coo_tensor(row_ids.unsqueeze(0), torch.randn(touched, dim), (rows, dim),
                                          check_invariants=True)
    ours = functional_qhm([table])  # one optimizer, one momentum buffer, for both kinds of step
    contestants = [
        Contestant("sparse", lambda: ours.step([sparse_grad]), calls=20),
        Contestant("dense", lambda: ours.step([dense_grad])),
        copy_contestant(numel),
    ]
    if with_reference:
        reference = reference_qhm([table.clone()], [dense_grad])
        contestants.insert(2, Contestant("reference", reference.step))
    samples = time_interleaved(contestants, rounds)
    return TableResult(
        rows=rows, dim=dim, touched=touched,
        sparse_s=statistics.median(samples["sparse"]),
        dense_s=statistics.median(samples["dense"]),
        reference_dense_s=statistics.median(samples["reference"]) if with_reference else None,
        floor_s=floor_seconds(samples["copy"]),
        copy_gbps=copy_gbps(samples["copy"], numel))


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def verdict(value: float, target: float) -> str:
    return "PASS" if value >= target else "BELOW"


def ns_per_element(seconds: float, numel: int) -> str:
    return "{:.3f}".format(seconds * 1e9 / numel)


def print_dense_table(results: List[DenseResult]) -> None:
    print("| case | ns/elem FunctionalQHM | ns/elem qhoptim | ns/elem floor | speedup vs qhoptim "
          "| % of floor speed | target | copy GB/s |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        speedup = r.reference_s / r.ours_s
        print("| {} | {} | {} | {} | {:.2f}x | {:.0f}% | >= {:g}x {} | {:.1f} |".format(
            r.label, ns_per_element(r.ours_s, r.numel), ns_per_element(r.reference_s, r.numel),
            ns_per_element(r.floor_s, r.numel), speedup, 100.0 * r.floor_s / r.ours_s,
            r.target, verdict(speedup, r.target), r.copy_gbps))


def print_table_case(r: TableResult) -> None:
    numel = r.rows * r.dim
    ratio = r.dense_s / r.sparse_s
    reference = "n/a" if r.reference_dense_s is None else ns_per_element(r.reference_dense_s, numel)
    print("| table | ns/table-elem sparse step | ns/table-elem dense step | ns/table-elem qhoptim dense "
          "| ns/elem floor | dense/sparse time | target | sparse step | dense step |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    print("| (c) {:,} x {} float32, {:,} rows touched | {} | {} | {} | {} | {:.0f}x | >= {:g}x {} "
          "| {:.1f} us | {:.1f} ms |".format(
              r.rows, r.dim, r.touched, ns_per_element(r.sparse_s, numel), ns_per_element(r.dense_s, numel),
              reference, ns_per_element(r.floor_s, numel), ratio, TARGET_SPARSE_VS_DENSE,
              verdict(ratio, TARGET_SPARSE_VS_DENSE), r.sparse_s * 1e6, r.dense_s * 1e3))


LEGEND = """\
Legend: ns/elem = median step time / elements (for the table: / table elements, touched or not).
FunctionalQHM runs scripted (ScriptedOptimizer); qhoptim is qhoptim.pyt.QHM; lr={lr}, momentum={m}, nu={nu}.
floor = {q} bytes/element (read param, grad, buffer; write param, buffer) at the best `dst.copy_(src)`
bandwidth of the run ({c} bytes/element), measured over one flat float32 tensor with the case's element
count. For (b) that is the floor the data could reach if it were contiguous, not 16,384 separate tensors.
% of floor speed = floor time / FunctionalQHM time. Caveat: copy_ is counted at 8 bytes/element, but the
cache also reads each dst line before writing it (write-allocate), so the copy really moves ~12; a step
at full memory speed (which writes only what it read) can show up to ~150% of this floor.
dense/sparse time = dense step of the whole table / sparse step touching the listed rows (same optimizer).""".format(
    lr=LR, m=MOMENTUM, nu=NU, q=QHM_BYTES_PER_ELEMENT, c=COPY_BYTES_PER_ELEMENT)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="FunctionalQHM step vs qhoptim vs the memory floor (CPU).")
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer rounds, a 1M-row table")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds for cases (a) and (b) (default 15, 5 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    # qhoptim calls add_(scalar, tensor), a deprecated signature that warns.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"qhoptim\.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rounds = args.rounds if args.rounds is not None else (5 if args.quick else 15)
    table_rounds = max(3, rounds // 3)
    table_rows = 1_000_000 if args.quick else 10_000_000
    torch.manual_seed(0)
    started = time.perf_counter()

    print("# Optimizer step benchmark: torch {}, {} threads, {} rounds ((c): {}){}".format(
        torch.__version__, torch.get_num_threads(), rounds, table_rounds, ", --quick" if args.quick else ""))
    print()

    dense_cases = [
        ("(a) 8 x 2,097,152", 8, 2_097_152, TARGET_SPEEDUP_FEW_LARGE),
        ("(b) 16,384 x 256", 16_384, 256, TARGET_SPEEDUP_MANY_SMALL),
    ]
    dense_results = []
    for label, count, size, target in dense_cases:
        progress("case {} float32: {} rounds ...".format(label, rounds))
        dense_results.append(dense_case(label, count, size, rounds, target))
        gc.collect()

    progress("case (c) {:,} x 16 float32 table, 1,000 rows touched: {} rounds ...".format(table_rows, table_rounds))
    table_result = table_case(table_rows, 16, 1_000, table_rounds, with_reference=True)
    gc.collect()

    print_dense_table(dense_results)
    print()
    print_table_case(table_result)
    print()
    print(LEGEND)
    progress("done in {:.0f} s".format(time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
