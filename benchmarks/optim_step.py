"""How fast is one optimizer step on a shard?  A side-by-side CPU benchmark.

What it measures
    Cases (a) to (c): nanoseconds per parameter element of one optimizer
    step for:

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

    Case (d), row-sparse steps of every optimizer the shards run: for dims
    16, 64 and 128, a table of 2,000,000 x dim float32 and COO gradients of
    1,000 distinct random rows each (sorted and marked coalesced, as a shard
    builds a push's gradient), microseconds per step and
    nanoseconds per touched row of SGD (momentum 0), QHM (lr 1.0, momentum
    0.9, nu 0.7), Adagrad, RowWiseAdagrad, Adam (``SparseAdam``'s lazy update
    of the touched rows) and FTRL, each looked up in ``functional_optim_map``
    as a shard does and run through ``ScriptedOptimizer``; against the memory
    floor of the bytes a row step must move (per touched row: read the row,
    its state and the gradient row, write the row and its state).

    Case (d) against FBGEMM, where ``fbgemm_gpu`` is importable (the
    ``fbgemm-gpu-cpu`` wheel, the ``bench`` extra: ``pip install -e
    '.[bench]'``, which ``make bench`` runs; never ``make test``): a table's
    sparse step, the lookup and the update of 1,000 distinct random rows of
    a 1,000,000 x dim table (``--fbgemm-table``), one thread, dims 16, 64
    and 128, float32 and float16 rows.  Ours: the shard's lookup
    (``rows.lookup``) then its push (``OwnerOptimizer.apply_rows``, made by
    ``owner_optimizer_for`` as in case (f): the native row kernel, float16
    rows rounded stochastically); FBGEMM's: its CPU module
    (``SplitTableBatchedEmbeddingBagsCodegen``, ``EmbeddingLocation.HOST``,
    ``weights_precision`` FP32 or FP16 with its default stochastic rounding)
    forward, then backward (its update is fused into backward), bags of one
    row.  RowWiseAdagrad against ``EXACT_ROWWISE_ADAGRAD``, SGD against
    ``EXACT_SGD``, the same lr (and eps).  Both first take the same step from
    equal tables, and the touched rows (and row-wise Adagrad's sums) are
    compared: equal but for rounding (float32 within 1e-6 of their size,
    float16 within one unit in the last place), or the share that is not.
    "ours / FBGEMM speed" is FBGEMM's step time over ours (target >= 1.5x).
    Where ``fbgemm_gpu`` does not import, one line says why and how to
    install it.

    Case (f), the native row kernel (``paramserver/optim/row_kernel.c``) against the torch path: the row
    step a shard's push ends in (a COO gradient of 1,000 distinct random rows, as ``OwnerOptimizer.apply_rows``
    builds it, applied in one part by the step module, ``PARAMSERVER_NATIVE=0``'s torch path, or by the
    kernel's ``NativeRows``, its best build here), to a table of 200,000 x dim rows (``--native-table``),
    float32 and float16 rows, dims 16, 64 and 128, for RowWiseAdagrad, SGD, SGD with momentum 0.9, QHM (at
    nu 0.7, the CTR job's, through its Nesterov form), Adagrad, FTRL and Adam (``SparseAdam``'s lazy update;
    ``--native-optimizers`` picks some), against the memory floor: one ``index_select`` and one ``index_copy_``
    of the push's rows and of each state tensor's rows (what a step must move, done by torch's fastest gather
    and scatter); the float32 and float16 contestants of a dim and optimizer run round-robin together.
    "torch / native" is the torch path's time over the kernel's, "x of floor" the floor's time
    over the kernel's (target >= 0.5x), and "float16 / float32" the kernel's float16 step over its float32
    one (target <= 1.1x).  Run it with ``--threads 1`` for one thread.

    Case (e), memory: the resident bytes a 20,000,000 x 16 float32 table
    (2,000,000 with ``--quick``) and its ``RowWiseAdagrad`` state take in
    this process once stepped, against the rows plus one float32 per row
    (target: within 2%).

How to run
    ``make bench``, or ``.venv/bin/python benchmarks/optim_step.py``.
    Options: ``--quick`` (a smoke run: fewer rounds, a 1M-row table for (c),
    a 200,000-row table for (d)), ``--cases LIST`` (comma-separated, any of
    ``dense`` = (a) and (b), ``table`` = (c), ``rows`` = (d), ``memory`` =
    (e), ``native`` = (f); default all),
    ``--rounds N`` (timed rounds for (a) and (b), 10 x N one-step samples for
    (d); the table case uses a third of them, at least 3), ``--row-table N``
    (rows of (d)'s table, default 2,000,000), ``--fbgemm-table N`` (rows of
    (d)'s tables against FBGEMM, default 1,000,000), ``--touched R``
    (distinct rows per step in (d), default 1,000), ``--threads N``
    (``torch.set_num_threads``; the default leaves torch's choice).  Progress
    goes to stderr; the results go to stdout as markdown tables that can be
    pasted into docs/benchmarks.md.
    The row case alone: ``.venv/bin/python benchmarks/optim_step.py --cases
    rows`` (a few minutes and about 8 GB of memory at dim 128; ``--quick``:
    seconds).

How to read it
    Contestants of a case run round-robin (A, B, copy, A, B, copy, ...) after
    a warm-up, so drifting machine load hits them all alike.  Optimizer times
    are the median over the rounds and ratios are ratios of medians; the copy
    bandwidth is the best round (the floor is what the memory system can do).
    "speedup vs qhoptim" is qhoptim time / FunctionalQHM time, "% of floor
    speed" is floor time / FunctionalQHM time (100% = memory bound).  Each
    target line says PASS or BELOW; the script always exits 0.  Timings on a
    shared machine are noisy: compare runs, not digits.

    Case (d): "us/step" is the median of one row-sparse step (one step per
    sample, 10 x rounds samples, so that few samples are cut by other
    processes on a busy machine; each round starts one contestant further
    on), "ns/row" that over the touched rows.  All optimizers of a dim step
    one shared table (each keeps its own state), and consecutive steps,
    whichever optimizer takes them, touch disjoint row sets drawn in turn
    from a rotation of 256 sets (fewer if the table is smaller), so a step
    finds its rows and state cold, as a server whose steps touch different
    rows does.  "floor us" is the step's bytes at the better of two copy
    bandwidths of the same run: a 64 MB flat copy (DRAM streaming, as the
    other cases' floor) and one copy of R x dim float32 from a rotation of
    cold blocks (what one operation moving a step's worth of rows out of
    memory achieves, its fixed cost included).  A copy of one small block
    over and over would run from cache at a bandwidth that cold rows never
    see, so it is not used.  "x of floor" is floor time / step time (target
    >= 0.5x); "RowWiseAdagrad / SGD" is the ratio of their step times (target
    <= 1.2x: one float of state per row should cost little over plain SGD).
    Against FBGEMM the two run in turn on one rotation of row sets, one step
    per sample.  The legend under the tables spells out the bytes.
"""

import argparse
import gc
import os
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from qhoptim.pyt import QHM

from paramserver.optim.ftrl import FTRL
from paramserver.optim.functional_qhm import FunctionalQHM
from paramserver.optim.qhm import QHM as LocalQHM
from paramserver.optim.registry import functional_optim_map
from paramserver.optim.rowwise_adagrad import RowWiseAdagrad
from paramserver.optim.row_kernel import RowKernels
from paramserver.optim.scripted import ScriptedOptimizer
from paramserver.shards.server import ShardState
from paramserver.shards.server.hosted import host_rows
from paramserver.shards.server.optimizers import owner_optimizer_for
from paramserver.shards.server.rows import lookup as shard_lookup, table_handles

# Small enough that parameters stay finite over hundreds of steps.
LR, MOMENTUM, NU = 1e-3, 0.9, 0.7
WARMUP_STEPS = 3
QHM_BYTES_PER_ELEMENT = 20  # read param, grad, buffer; write param, buffer
COPY_BYTES_PER_ELEMENT = 8  # read src, write dst

TARGET_SPEEDUP_FEW_LARGE = 1.8
TARGET_SPEEDUP_MANY_SMALL = 4.0
TARGET_SPARSE_VS_DENSE = 100.0

CASES = ("dense", "table", "rows", "memory", "native")
ROW_DIMS = (16, 64, 128)
ROW_TABLE_ROWS, ROW_TABLE_ROWS_QUICK = 2_000_000, 200_000
ROW_TOUCHED = 1_000
ROW_ROTATION = 256  # disjoint row sets consecutive steps draw in turn
ROW_SAMPLES_PER_ROUND = 10  # (d) times one step per sample, 10 x rounds samples: short samples, few preempted
STREAM_COPY_NUMEL = 16 * 1024 * 1024  # 64 MB per tensor: DRAM, not cache
FLOAT_BYTES = 4
TARGET_ROW_FLOOR = 0.5  # floor time / step time, each optimizer
TARGET_ROWWISE_VS_SGD = 1.2  # RowWiseAdagrad time / SGD time, at most
ADAGRAD_LR, ADAGRAD_EPS = 0.01, 1e-8
NATIVE_TABLE_ROWS = 200_000
NATIVE_TYPES = (torch.float32, torch.float16)
#: (f)'s optimizers: name, local class, options (QHM at nu 1, its form the kernel runs: at other nu its fused
#: form is Nesterov momentum, which the kernel declines).
NATIVE_OPTIMIZERS = (("RowWiseAdagrad", RowWiseAdagrad, dict(lr=ADAGRAD_LR, eps=ADAGRAD_EPS)),
                     ("SGD", torch.optim.SGD, dict(lr=LR)),
                     ("SGD momentum", torch.optim.SGD, dict(lr=LR, momentum=MOMENTUM)),
                     ("QHM", LocalQHM, dict(lr=LR, momentum=MOMENTUM, nu=0.7)),
                     ("Adagrad", torch.optim.Adagrad, dict(lr=ADAGRAD_LR, eps=ADAGRAD_EPS)),
                     ("FTRL", FTRL, dict(lr=LR, l1=0.001)),
                     ("Adam", torch.optim.SparseAdam, dict(lr=1e-3)))
ROTATION_SEED = 0  # the contestants' order in each round of a rotated timing (time_interleaved)
TARGET_NATIVE_FLOOR = 0.5  # floor time / kernel step time
TARGET_HALF_VS_FLOAT = 1.1  # kernel's float16 step time / its float32 step time, at most


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

@dataclass
class Contestant:
    """One thing to time; a sample runs ``step`` ``calls`` times (for very short steps)."""

    name: str
    step: Callable[[], None]
    calls: int = 1


def time_interleaved(contestants: Sequence[Contestant], rounds: int, rotate: bool = False) -> Dict[str, List[float]]:
    """Seconds per call of each contestant, one sample per round, round-robin after a warm-up.

    ``rotate``: each round runs them in a new order (shuffled, seeded), so that none always runs right after
    the same one (say, a copy that flushed the caches, or a heavier step that left them cold: starting each
    round one further on keeps who follows whom)."""
    for contestant in contestants:
        for _ in range(WARMUP_STEPS):
            contestant.step()
    samples: Dict[str, List[float]] = {c.name: [] for c in contestants}
    orders = random.Random(ROTATION_SEED)
    for _ in range(rounds):
        order = list(contestants)
        if rotate:
            orders.shuffle(order)
        for contestant in order:
            start = time.perf_counter_ns()
            for _ in range(contestant.calls):
                contestant.step()
            elapsed = time.perf_counter_ns() - start
            samples[contestant.name].append(elapsed * 1e-9 / contestant.calls)
    return samples


def copy_contestant(numel: int, name: str = "copy") -> Contestant:
    """``dst.copy_(src)`` over two flat float32 tensors of ``numel`` elements."""
    src = torch.randn(numel)
    dst = torch.empty(numel)
    return Contestant(name, lambda: dst.copy_(src))


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

@dataclass
class RowOptimizer:
    """One optimizer of case (d): its local class (looked up in ``functional_optim_map``, as a shard does),
    hyperparameters, and the state a row step must read and write per touched row."""

    name: str
    local_cls: type
    kwargs: Dict[str, float]
    state_rows: int  # float32 state tensors shaped like the table
    state_floats: int  # float32 state values per row besides those (RowWiseAdagrad's one)
    state_label: str

    def bytes_per_row(self, dim: int) -> int:
        """Read the row, the gradient row and the row's state; write the row and its state."""
        row = FLOAT_BYTES * dim
        state = self.state_rows * row + FLOAT_BYTES * self.state_floats
        return 3 * row + 2 * state


ROW_OPTIMIZERS = (
    RowOptimizer("SGD", torch.optim.SGD, dict(lr=0.01, momentum=0.0), 0, 0, "none"),
    RowOptimizer("QHM", LocalQHM, dict(lr=1.0, momentum=0.9, nu=0.7), 1, 0, "1 row"),
    RowOptimizer("Adagrad", torch.optim.Adagrad, dict(lr=ADAGRAD_LR), 1, 0, "1 row (+ step scalar)"),
    RowOptimizer("RowWiseAdagrad", RowWiseAdagrad, dict(lr=ADAGRAD_LR, eps=ADAGRAD_EPS), 0, 1, "1 float"),
    RowOptimizer("Adam", torch.optim.SparseAdam, dict(lr=1e-3), 2, 0, "2 rows (+ step scalar)"),
    RowOptimizer("FTRL", FTRL, dict(lr=0.1), 2, 0, "2 rows"),
)


class RowRotation:
    """``sets`` disjoint sets of ``touched`` random rows of a ``rows x dim`` table, each with a COO gradient
    of its own (sorted distinct rows marked coalesced, as a shard builds a push's gradient:
    ``optimizers._row_gradient``), taken in turn by ``take()``: consecutive steps, whoever takes them, touch
    different rows."""

    def __init__(self, rows: int, dim: int, touched: int, sets: int):
        self.ids = torch.randperm(rows)[:sets * touched].view(sets, touched).sort(1).values
        self.values = torch.randn(sets * touched, dim).view(sets, touched, dim)
        self.grads = [torch.sparse_coo_tensor(self.ids[k].unsqueeze(0), self.values[k], (rows, dim),
                                              check_invariants=True, is_coalesced=True) for k in range(sets)]
        self.next = 0

    def take(self) -> int:
        k = self.next
        self.next = (k + 1) % len(self.grads)
        return k


def rows_copy_contestant(touched: int, dim: int, sets: int) -> Contestant:
    """``dst.copy_(src)`` of one ``touched x dim`` float32 block per call, the blocks taken in turn from
    ``sets`` of them (cold, as a step's rows are)."""
    src = torch.randn(sets, touched * dim)
    dst = torch.zeros(sets, touched * dim)  # written once: no first-touch page faults in the timing
    turn = [0]

    def step() -> None:
        k = turn[0]
        turn[0] = (k + 1) % sets
        dst[k].copy_(src[k])

    return Contestant("copy rows", step)


@dataclass
class RowsResult:
    rows: int
    dim: int
    touched: int
    sets: int
    step_s: Dict[str, float]  # optimizer name -> median seconds per row step
    stream_gbps: float
    rows_gbps: float

    @property
    def floor_gbps(self) -> float:
        return max(self.stream_gbps, self.rows_gbps)

    def floor_s(self, optimizer: RowOptimizer) -> float:
        return self.touched * optimizer.bytes_per_row(self.dim) / (self.floor_gbps * 1e9)


def rows_case(rows: int, dim: int, touched: int, rounds: int) -> RowsResult:
    """Case (d): a row-sparse step of ``touched`` rows of a ``rows x dim`` table, per optimizer; one step per
    sample, ``ROW_SAMPLES_PER_ROUND x rounds`` samples each."""
    sets = max(1, min(ROW_ROTATION, rows // touched))
    table = torch.randn(rows, dim)  # one table, stepped by every optimizer (each keeps its own state)
    rotation = RowRotation(rows, dim, touched, sets)
    contestants = []
    for spec in ROW_OPTIMIZERS:
        optimizer = ScriptedOptimizer(functional_optim_map[spec.local_cls], [table], **spec.kwargs)
        contestants.append(Contestant(
            spec.name, lambda optimizer=optimizer: optimizer.step([rotation.grads[rotation.take()]])))
    contestants.append(copy_contestant(STREAM_COPY_NUMEL, "copy stream"))
    contestants.append(rows_copy_contestant(touched, dim, sets))
    samples = time_interleaved(contestants, rounds * ROW_SAMPLES_PER_ROUND, rotate=True)
    return RowsResult(
        rows=rows, dim=dim, touched=touched, sets=sets,
        step_s={spec.name: statistics.median(samples[spec.name]) for spec in ROW_OPTIMIZERS},
        stream_gbps=copy_gbps(samples["copy stream"], STREAM_COPY_NUMEL),
        rows_gbps=copy_gbps(samples["copy rows"], touched * dim))


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


def print_rows_case(results: List[RowsResult]) -> None:
    print("| (d) dim | optimizer | state per row | bytes/row | us/step | ns/row | floor us | x of floor | target |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        for spec in ROW_OPTIMIZERS:
            step_s, floor_s = r.step_s[spec.name], r.floor_s(spec)
            print("| {} | {} | {} | {:,} | {:.1f} | {:.0f} | {:.1f} | {:.2f}x | >= {:g}x {} |".format(
                r.dim, spec.name, spec.state_label, spec.bytes_per_row(r.dim), step_s * 1e6,
                step_s * 1e9 / r.touched, floor_s * 1e6, floor_s / step_s, TARGET_ROW_FLOOR,
                verdict(floor_s / step_s, TARGET_ROW_FLOOR)))
    print()
    print("| (d) dim | table | rows/step | rotation | copy GB/s, 64 MB stream | copy GB/s, R x dim blocks "
          "| floor at | RowWiseAdagrad / SGD | target |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        ratio = r.step_s["RowWiseAdagrad"] / r.step_s["SGD"]
        print("| {} | {:,} x {} float32 | {:,} | {} sets | {:.1f} | {:.1f} | {:.1f} GB/s | {:.2f}x "
              "| <= {:g}x {} |".format(
            r.dim, r.rows, r.dim, r.touched, r.sets, r.stream_gbps, r.rows_gbps, r.floor_gbps, ratio,
            TARGET_ROWWISE_VS_SGD, "PASS" if ratio <= TARGET_ROWWISE_VS_SGD else "BELOW"))


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

ROWS_LEGEND = """\
(d) Legend: us/step = median time of one row-sparse step (ScriptedOptimizer over the functional class that
functional_optim_map gives: one COO gradient of R distinct rows; one step per sample, {per} x rounds samples,
interleaved step by step, each round starting one contestant further on); ns/row = us/step / R.
Hyperparameters: SGD lr=0.01 momentum=0; QHM lr=1.0 momentum=0.9 nu=0.7; Adagrad lr={alr}; RowWiseAdagrad
lr={alr} eps={aeps}; Adam lr=1e-3 (SparseAdam: the lazy update of the touched rows); FTRL lr=0.1.
All optimizers of a dim step one table (each its own state). Consecutive steps, whichever optimizer takes
them, touch disjoint sets of R random rows taken in turn from the rotation (each set with a gradient of its
own), so a step finds its rows and state out of cache, as on a server whose steps touch different rows.
bytes/row = read the row, the gradient row and the row's state, write the row and its state, float32:
3 x 4 x dim + 2 x state, state per row: SGD none, QHM 1 row (momentum), Adagrad 1 row (sum), RowWiseAdagrad
4 bytes (one float), Adam 2 rows (exp_avg, exp_avg_sq), FTRL 2 rows (accumulator, linear). Adagrad's and Adam's
step counts are one scalar per table, not per row, and are not counted; nor are the row indices, the sort
that coalescing the gradient does, or temporaries: the floor is a lower bound on the time.
floor us = R x bytes/row at the better (higher) of the two copy bandwidths of the same run, both
`dst.copy_(src)` counted at 8 bytes per element: "64 MB stream" (flat tensors far larger than the caches:
DRAM streaming, as the floor of (a)-(c)) and "R x dim blocks" (one copy of a block the size of a step's R
rows per call, the blocks taken in turn from as many as the rotation has sets, so they come from memory as
the rows do; one operation's fixed cost included). Copying one small block over and over would run from
cache, at a bandwidth that a step's cold rows never see, so that is not used. Caveat: the cache reads
each dst line before writing it (write-allocate), so a copy really moves ~12 bytes per element; a step at
full memory speed can show up to ~1.5x.
x of floor = floor time / step time (1.00x = memory bound); target >= {target:g}x for each optimizer.
RowWiseAdagrad / SGD = ratio of their median step times; target <= {rw:g}x (one float of state per row
should cost little over plain SGD).""".format(
    per=ROW_SAMPLES_PER_ROUND, alr=ADAGRAD_LR, aeps=ADAGRAD_EPS, target=TARGET_ROW_FLOOR, rw=TARGET_ROWWISE_VS_SGD)


# --------------------------------------------------------------------------
# Case (e): what a shard's table costs in memory with row-wise Adagrad
# --------------------------------------------------------------------------

MEMORY_TARGET = 1.02  # rows + one float32 per row, at most this many times


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_case(rows: int, dim: int, touched: int) -> str:
    """Resident bytes a ``rows x dim`` float32 table and its ``RowWiseAdagrad`` state take once stepped (a
    step's temporaries freed), against the rows plus one float32 per row: a markdown table with the target."""
    gc.collect()
    before = resident_bytes()
    table = torch.empty(rows, dim).normal_()
    optimizer = ScriptedOptimizer(functional_optim_map[RowWiseAdagrad], [table], lr=0.01)
    ids = torch.randperm(rows)[:touched].sort().values
    gradient = torch.sparse_coo_tensor(ids.unsqueeze(0), torch.randn(touched, dim), (rows, dim), is_coalesced=True)
    optimizer.step([gradient])
    del ids, gradient
    gc.collect()
    held = resident_bytes() - before
    expected = rows * dim * 4 + rows * 4
    ratio = held / expected
    return ("| (e) table | rows MB | + one float per row MB | resident MB | resident / (rows + one float per row) "
            "| target |\n|---|---:|---:|---:|---:|---|\n| {:,} x {} float32, RowWiseAdagrad | {:.1f} | {:.1f} | {:.1f} "
            "| {:.4f}x | <= {:g}x {} |".format(rows, dim, rows * dim * 4 / 1e6, rows * 4 / 1e6, held / 1e6, ratio,
                                                MEMORY_TARGET, "PASS" if ratio <= MEMORY_TARGET else "BELOW"))


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

@dataclass
class NativeResult:
    dtype: torch.dtype
    dim: int
    optimizer: str
    torch_s: float
    native_s: float
    floor_s: float
    kernel: str


def native_case(rows: int, dim: int, dtypes: Sequence[torch.dtype], touched: int, rounds: int, name: str,
                optimizer_cls, options: dict) -> List[NativeResult]:
    """Case (f) for one optimizer and dim: for each row type of ``dtypes``, the torch path's push, the kernel's,
    and the floor, all round-robin in one run (so that the kernel's float16 / float32 ratio compares steps
    timed under the same load)."""
    contestants, owners = [], {}
    for dtype in dtypes:
        # a rotation for each row type: each of its three contestants takes every set in turn
        rotation = RowRotation(rows, dim, touched, min(ROW_ROTATION, rows // touched))
        for choice in ("torch", "best"):
            state = ShardState(row_kernels=RowKernels(choice))
            table = host_rows(state, f"bench.{choice}[0:{rows}]", rows, dim, dtype, 0, 0, shared=True, init_std=0.01)
            owner = owner_optimizer_for(state, optimizer_cls, [table], [0], (), options)
            owner._impl.set_parts(1)  # one thread
            owner.apply_rows([0], [rotation.ids[0]], [rotation.values[0]], "bench")  # the state made; the kernel loaded
            owners[dtype, choice] = (owner, table)
            # the row step a push ends in: the step module's (torch), or the kernel's, on the push's COO gradient
            apply = owner._impl.apply if choice == "torch" else owner._native_rows().apply
            contestants.append(Contestant(f"{choice} {dtype}", lambda apply=apply, rotation=rotation:
                                          apply([rotation.grads[rotation.take()]], False)))
        reference, table = owners[dtype, "torch"]
        moved = [table, *[state for state in reference._impl.row_state(0) if state.dim() > 0]]  # (no step count)

        def floor(moved=moved, rotation=rotation) -> None:
            ids = rotation.ids[rotation.take()]
            with torch.no_grad():
                for tensor in moved:
                    tensor.index_copy_(0, ids, tensor.index_select(0, ids))

        contestants.append(Contestant(f"floor {dtype}", floor))
    samples = time_interleaved(contestants, rounds * ROW_SAMPLES_PER_ROUND, rotate=True)
    results = []
    for dtype in dtypes:
        native = owners[dtype, "best"][0]._native_rows()
        results.append(NativeResult(dtype, dim, name, statistics.median(samples[f"torch {dtype}"]),
                                    statistics.median(samples[f"best {dtype}"]),
                                    statistics.median(samples[f"floor {dtype}"]),
                                    native.kernel.variant if native else "none (torch)"))
    return results


def print_native_case(results: List[NativeResult]) -> None:
    print("| (f) rows | dim | optimizer | torch us | native us | floor us | torch / native | x of floor | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r.floor_s / r.native_s
        print("| {} | {} | {} | {:.0f} | {:.0f} | {:.0f} | {:.2f}x | {:.2f}x | >= {:g}x {} |".format(
            str(r.dtype).replace("torch.", ""), r.dim, r.optimizer, r.torch_s * 1e6, r.native_s * 1e6,
            r.floor_s * 1e6, r.torch_s / r.native_s, ratio, TARGET_NATIVE_FLOOR, verdict(ratio, TARGET_NATIVE_FLOOR)))
    print()
    print("| (f) dim | optimizer | native float16 / float32 | target |")
    print("|---|---|---|---|")
    by_key = {(r.dtype, r.dim, r.optimizer): r for r in results}
    for r in results:
        half = by_key.get((torch.float16, r.dim, r.optimizer))
        if r.dtype == torch.float32 and half is not None:
            ratio = half.native_s / r.native_s
            print("| {} | {} | {:.2f}x | <= {:g}x {} |".format(r.dim, r.optimizer, ratio, TARGET_HALF_VS_FLOAT,
                                                              "PASS" if ratio <= TARGET_HALF_VS_FLOAT else "ABOVE"))
    print()
    print("(f): the kernel's build: {}; floor = one index_select and one index_copy_ of the push's rows and of "
          "each state tensor's.".format(results[0].kernel if results else "-"))


# --------------------------------------------------------------------------
# Case (d) against FBGEMM's CPU table-batched embedding kernel
# --------------------------------------------------------------------------

FBGEMM_TABLE_ROWS = 1_000_000
FBGEMM_TYPES = (torch.float32, torch.float16)
#: Ours (name, local class, options) beside FBGEMM's optimizer of the same update (an ``OptimType`` name).
FBGEMM_OPTIMIZERS = (("RowWiseAdagrad", RowWiseAdagrad, dict(lr=ADAGRAD_LR, eps=ADAGRAD_EPS), "EXACT_ROWWISE_ADAGRAD"),
                     ("SGD", torch.optim.SGD, dict(lr=LR), "EXACT_SGD"))
TARGET_VS_FBGEMM = 1.5  # FBGEMM's step time / ours, at least
FBGEMM_INSTALL = ("install the bench extra, `pip install -e '.[bench]'` in a checkout (`make bench` does): the "
                  "fbgemm-gpu-cpu wheel, on Linux; it leaves torch as it is")


def load_fbgemm() -> Tuple[Optional[Dict[str, object]], str]:
    """FBGEMM's CPU table-batched embedding training API, if ``fbgemm_gpu`` imports (and registers its operators
    under this torch): (names, version), or (None, why not).  An optional comparison: ``fbgemm_gpu`` is the
    ``bench`` extra's, never the package's or the tests'."""
    try:
        import fbgemm_gpu
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    except (ImportError, OSError, RuntimeError, AttributeError) as error:  # absent, or built for another torch
        reason = (str(error).strip().splitlines() or [""])[0]
        return None, "{}: {}".format(type(error).__name__, reason[:200])
    names = dict(EmbOptimType=EmbOptimType, SparseType=SparseType, EmbeddingLocation=EmbeddingLocation,
                 PoolingMode=PoolingMode, ComputeDevice=ComputeDevice, Codegen=SplitTableBatchedEmbeddingBagsCodegen)
    return names, str(getattr(fbgemm_gpu, "__version__", "version unknown"))


def fbgemm_module(fbgemm: Dict[str, object], table: torch.Tensor, optim_type: str, options: dict):
    """FBGEMM's CPU module (``EmbeddingLocation.HOST``) over a copy of ``table`` (float32, or float16 as
    ``SparseType.FP16`` with FBGEMM's default stochastic rounding), optimizer ``optim_type`` with ``options``'
    lr (and eps), bags of one row pooled by sum: its forward is the lookup, its backward the update."""
    precision = fbgemm["SparseType"].FP32 if table.dtype == torch.float32 else fbgemm["SparseType"].FP16
    settings = dict(learning_rate=options["lr"])
    if "eps" in options:
        settings["eps"] = options["eps"]
    emb = fbgemm["Codegen"](
        [(table.size(0), table.size(1), fbgemm["EmbeddingLocation"].HOST, fbgemm["ComputeDevice"].CPU)],
        optimizer=getattr(fbgemm["EmbOptimType"], optim_type), weights_precision=precision,
        stochastic_rounding=True, pooling_mode=fbgemm["PoolingMode"].SUM, **settings)
    weights = emb.split_embedding_weights()[0]
    if weights.dtype != table.dtype:
        raise TypeError(f"FBGEMM keeps {weights.dtype} rows for {precision}, not {table.dtype}")
    with torch.no_grad():
        weights.copy_(table)
    return emb


@dataclass
class FbgemmResult:
    dtype: torch.dtype
    dim: int
    optimizer: str
    ours_s: float
    fbgemm_s: float
    difference: float  # largest |ours - FBGEMM| of a row or a state value after the same first step
    beyond: float  # the share of those values that differ by more than rounding (``beyond_rounding``)
    kernel: str


def beyond_rounding(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> float:
    """The share of ``ours`` that differ from ``theirs`` by more than rounding: float32 values by more than 1e-6
    of their size (at least 1e-6: the order of a sum may differ), float16 by more than one unit in the last place
    (each side may round stochastically, to either float16 value around the same float32 result)."""
    ours, theirs = ours.float(), theirs.float()
    if dtype == torch.float16:
        unit = (theirs.abs() * 2.0 ** -10).clamp_min(2.0 ** -24)  # one unit in the last place, or a little over
    else:
        unit = theirs.abs().clamp_min(1.0) * 1e-6
    return float(((ours - theirs).abs() > unit).float().mean()) if ours.numel() else 0.0


def fbgemm_case(fbgemm: Dict[str, object], rows: int, dim: int, dtype: torch.dtype, touched: int, rounds: int,
                name: str, optimizer_cls, options: dict, optim_type: str) -> FbgemmResult:
    """One optimizer, row type and dim: ours (the shard's lookup, then its push: ``OwnerOptimizer.apply_rows``,
    the native row kernel where it is built) and FBGEMM's (forward, then backward, which updates) on the same
    rows: first one step each from equal tables, compared, then timed in turn on a rotation of row sets."""
    rotation = RowRotation(rows, dim, touched, max(1, min(ROW_ROTATION, rows // touched)))
    state = ShardState(row_kernels=RowKernels("best"))
    table = host_rows(state, f"bench.fbgemm[0:{rows}]", rows, dim, dtype, 0, 0, shared=True, init_std=0.01)
    incarnation, (handle,) = table_handles(state, [table])
    owner = owner_optimizer_for(state, optimizer_cls, [table], [0], (), options)
    owner._impl.set_parts(1)  # one thread
    emb = fbgemm_module(fbgemm, table.detach(), optim_type, options)
    offsets = torch.arange(touched + 1, dtype=torch.int64)

    def ours() -> None:
        k = rotation.take()
        shard_lookup(state, incarnation, [handle], rotation.ids[k], [touched], -1)
        owner.apply_rows([0], [rotation.ids[k]], [rotation.values[k]], "bench")

    def theirs() -> None:
        k = rotation.take()
        emb(rotation.ids[k], offsets).backward(rotation.values[k])

    first = rotation.ids[0]
    ours()
    rotation.next = 0
    theirs()  # the same first step: set 0's rows and gradients
    compared = [(table.detach().index_select(0, first), emb.split_embedding_weights()[0].index_select(0, first))]
    if name == "RowWiseAdagrad":
        (sums,) = owner._impl.row_state(0)
        compared.append((sums.index_select(0, first), emb.split_optimizer_states()[0][0].index_select(0, first)))
    difference = max(float((a.float() - b.float()).abs().max()) for a, b in compared)
    beyond = max(beyond_rounding(a, b, dtype if a.dtype == dtype else torch.float32) for a, b in compared)
    samples = time_interleaved([Contestant("ours", ours), Contestant("fbgemm", theirs)],
                               rounds * ROW_SAMPLES_PER_ROUND, rotate=True)
    native = owner._native_rows()
    return FbgemmResult(dtype, dim, name, statistics.median(samples["ours"]), statistics.median(samples["fbgemm"]),
                        difference, beyond, native.kernel.variant if native else "none (torch path)")


def fbgemm_comparison(rows: int, touched: int, rounds: int, dims: Sequence[int] = ROW_DIMS,
                      types: Sequence[torch.dtype] = FBGEMM_TYPES) -> List[FbgemmResult]:
    """Case (d) against FBGEMM, one thread, each row type, dim and optimizer of ``FBGEMM_OPTIMIZERS``: its table
    printed; where ``fbgemm_gpu`` does not import, one line saying why and how to install it (never a failure)."""
    fbgemm, version = load_fbgemm()
    if fbgemm is None:
        print("(d) against FBGEMM: not run, fbgemm_gpu is not importable ({}); to compare: {}.".format(
            version, FBGEMM_INSTALL))
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = []
    try:
        for dtype in types:
            for dim in dims:
                for name, optimizer_cls, options, optim_type in FBGEMM_OPTIMIZERS:
                    progress("case (d) against FBGEMM: {:,} x {} {} rows, {}: {} samples ...".format(
                        rows, dim, dtype, name, rounds * ROW_SAMPLES_PER_ROUND))
                    results.append(fbgemm_case(fbgemm, rows, dim, dtype, touched, rounds, name, optimizer_cls,
                                               options, optim_type))
                    gc.collect()
    finally:
        torch.set_num_threads(threads)
    print_fbgemm_comparison(results, rows, touched, version)
    return results


def print_fbgemm_comparison(results: List[FbgemmResult], rows: int, touched: int, version: str) -> None:
    print("| (d) rows | dim | optimizer | ours us | FBGEMM us | ours / FBGEMM speed | target | same first step: "
          "rows (and state) |")
    print("|---|---:|---|---:|---:|---:|---|---|")
    for r in results:
        speed = r.fbgemm_s / r.ours_s
        same = "yes" if r.beyond == 0.0 else "NO: {:.2%} of values beyond rounding,".format(r.beyond)
        print("| {} | {} | {} | {:.0f} | {:.0f} | {:.2f}x | >= {:g}x {} | {} max {:.1e} |".format(
            str(r.dtype).replace("torch.", ""), r.dim, r.optimizer, r.ours_s * 1e6, r.fbgemm_s * 1e6, speed,
            TARGET_VS_FBGEMM, verdict(speed, TARGET_VS_FBGEMM), same, r.difference))
    print()
    print("(d) against FBGEMM: fbgemm_gpu {}, one thread, a {:,}-row table, {:,} distinct rows a step; ours: the "
          "shard's lookup then its push (the row kernel's {} build); FBGEMM: SplitTableBatchedEmbeddingBagsCodegen "
          "on CPU (EmbeddingLocation.HOST), forward then backward.".format(
              version, rows, touched, results[0].kernel if results else "-"))


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_cases(text: str) -> List[str]:
    cases = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in cases if name not in CASES]
    if not cases or unknown:
        raise argparse.ArgumentTypeError("expected a comma-separated list of {}, got {!r}".format(
            ", ".join(CASES), text))
    return cases


def parse_native_optimizers(text: str) -> List[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = [name for name, _, _ in NATIVE_OPTIMIZERS]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError("unknown case (f) optimizers {} (known: {})".format(unknown, ", ".join(known)))
    return names


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Optimizer steps vs their references vs the memory floor (CPU): FunctionalQHM dense and "
                    "sparse, and a row-sparse step of every functional optimizer.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: fewer rounds, a 1M-row table for (c), a 200,000-row table for (d)")
    parser.add_argument("--cases", type=parse_cases, default=list(CASES),
                        help="comma-separated cases to run: dense = (a) and (b), table = (c), rows = (d), memory = (e) "
                             "(default: all)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds for cases (a) and (b), {} x that many one-step samples for (d) "
                             "(default 15, 5 with --quick)".format(ROW_SAMPLES_PER_ROUND))
    parser.add_argument("--row-table", type=int, default=None,
                        help="rows of case (d)'s table (default {:,}, {:,} with --quick)".format(
                            ROW_TABLE_ROWS, ROW_TABLE_ROWS_QUICK))
    parser.add_argument("--touched", type=int, default=ROW_TOUCHED,
                        help="distinct rows a step of case (d) touches (default {:,})".format(ROW_TOUCHED))
    parser.add_argument("--native-table", type=int, default=NATIVE_TABLE_ROWS,
                        help="rows of case (f)'s tables (default {:,})".format(NATIVE_TABLE_ROWS))
    parser.add_argument("--fbgemm-table", type=int, default=None,
                        help="rows of the tables case (d) compares with FBGEMM's on (default {:,}, {:,} with "
                             "--quick)".format(FBGEMM_TABLE_ROWS, ROW_TABLE_ROWS_QUICK))
    parser.add_argument("--native-optimizers", type=parse_native_optimizers,
                        default=[name for name, _, _ in NATIVE_OPTIMIZERS],
                        help="comma-separated optimizers of case (f), of: {} (default: all)".format(
                            ", ".join(name for name, _, _ in NATIVE_OPTIMIZERS)))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.row_table is None:
        args.row_table = ROW_TABLE_ROWS_QUICK if args.quick else ROW_TABLE_ROWS
    if args.fbgemm_table is None:
        args.fbgemm_table = ROW_TABLE_ROWS_QUICK if args.quick else FBGEMM_TABLE_ROWS
    if args.touched < 1 or min(args.row_table, args.fbgemm_table) < args.touched:
        parser.error("--touched must be at least 1 and at most --row-table ({:,}) and --fbgemm-table ({:,})".format(
            args.row_table, args.fbgemm_table))
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


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

    print("# Optimizer step benchmark: torch {}, {} threads, {} rounds ((c): {}), cases {}{}".format(
        torch.__version__, torch.get_num_threads(), rounds, table_rounds, ",".join(args.cases),
        ", --quick" if args.quick else ""))
    print()

    dense_cases = [
        ("(a) 8 x 2,097,152", 8, 2_097_152, TARGET_SPEEDUP_FEW_LARGE),
        ("(b) 16,384 x 256", 16_384, 256, TARGET_SPEEDUP_MANY_SMALL),
    ]
    dense_results = []
    if "dense" in args.cases:
        for label, count, size, target in dense_cases:
            progress("case {} float32: {} rounds ...".format(label, rounds))
            dense_results.append(dense_case(label, count, size, rounds, target))
            gc.collect()

    table_result = None
    if "table" in args.cases:
        progress("case (c) {:,} x 16 float32 table, 1,000 rows touched: {} rounds ...".format(
            table_rows, table_rounds))
        table_result = table_case(table_rows, 16, 1_000, table_rounds, with_reference=True)
        gc.collect()

    rows_results = []
    if "rows" in args.cases:
        for dim in ROW_DIMS:
            progress("case (d) {:,} x {} float32 table, {:,} rows per step, {} optimizers: {} samples ...".format(
                args.row_table, dim, args.touched, len(ROW_OPTIMIZERS), rounds * ROW_SAMPLES_PER_ROUND))
            rows_results.append(rows_case(args.row_table, dim, args.touched, rounds))
            gc.collect()

    if dense_results:
        print_dense_table(dense_results)
        print()
    if table_result is not None:
        print_table_case(table_result)
        print()
    if rows_results:
        print_rows_case(rows_results)
        print()
        fbgemm_comparison(args.fbgemm_table, args.touched, rounds)
        print()
    if "native" in args.cases:
        native_results = []
        for dim in ROW_DIMS:
            for name, optimizer_cls, options in NATIVE_OPTIMIZERS:
                if name not in args.native_optimizers:
                    continue
                progress("case (f) {} x {} rows of {}, {}: {} samples ...".format(
                    args.native_table, dim, " and ".join(map(str, NATIVE_TYPES)), name, rounds * ROW_SAMPLES_PER_ROUND))
                native_results.extend(native_case(args.native_table, dim, NATIVE_TYPES, args.touched, rounds, name,
                                                  optimizer_cls, options))
                gc.collect()
        native_results.sort(key=lambda r: NATIVE_TYPES.index(r.dtype))  # (stable: by dim and optimizer within)
        print_native_case(native_results)
        print()
    if "memory" in args.cases:  # last: what the other cases allocated is freed by then
        progress("case (e) memory ...")
        print(memory_case(2_000_000 if args.quick else 20_000_000, 16, args.touched))
        print()
    if dense_results or table_result is not None:
        print(LEGEND)
    if rows_results:
        if dense_results or table_result is not None:
            print()
        print(ROWS_LEGEND)
    progress("done in {:.0f} s".format(time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
