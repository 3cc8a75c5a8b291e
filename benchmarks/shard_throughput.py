"""How many rows can one shard apply and serve per second?  Pushers flooding one shard process.

What it measures
    One shard server (``run_shard_server``, on loopback, TCP transport) holds
    one table of ``--table-rows`` rows (1,000,000) x dim float32 with its
    owner-side optimizer (``paramserver.optim.QHM``: lr 0.01, momentum 0.9,
    nu 0.7; ``paramserver.optim.RowWiseAdagrad``: lr 0.01, eps 1e-8), made as
    a trainer makes them (``ShardedEmbeddingBag``, ``DistributedOptimizer``,
    ``EmbeddingCollection`` for the handles).  Pusher processes
    (``--pushers``, 2) send it requests of R distinct sorted rows (``--rows``:
    1,000 and 16,384) through the trainer's own RPC targets, with the
    arguments ``EmbeddingCollection.send`` builds (ids and gradients packed by
    ``paramserver.shards.wire``, table and optimizer handles):

    * pushes: ``service.push_lookup`` carrying one push and no read (what a
      trainer's push is), not idempotent (step -1: with several shard threads
      one pusher's pushes may be applied out of order);
    * lookups: ``service.lookup`` of the same rows;
    * no-op pushes: the pushes' very arguments sent to ``rpc_floor.push_floor``,
      a TorchScript target that does nothing with them: torch RPC's own cost
      of a push, which bounds what a push over RPC can reach (the ceiling).
      It and the pushes are also timed unheld (``Driver.unheld``): the shard
      receives while its threads are held, so the backlog's CPU leaves the
      receiving out; unheld, the shard's CPU per request counts it.

    Each request takes the next of a rotation of disjoint row sets, so its
    rows are cold.  Two ways of sending, each timed for ``--seconds``:

    * backlog: the shard's RPC worker threads are held (an RPC that sleeps
      until a deadline, one per thread) while the pushers send a batch of
      requests (64 MB per pusher, 8 to 1,000 requests; a batch still
      arriving, the shard still busy in the last 30 ms, is sent again with a
      longer hold); from the deadline on
      the shard works through them while the pushers only wait.  Timed from
      the deadline to the last reply.  Requests are made in advance and the
      pushers' work does not share the cores with the shard's, so this is the
      shard's own rate;
    * live: each pusher keeps 4 requests in flight for the whole window
      (what trainers do; the pushers' own sending shares the cores); with
      the first thread configuration only, unless ``--live-all``.

    For each: rows per second of wall time, rows per second of the shard
    process's CPU time (``/proc/PID/task/*/schedstat``: every thread of the
    shard, in nanoseconds), and the cores the shard used (CPU / wall).  The
    shard runs once per ``--thread-configs`` entry ``AxBxC``: A RPC worker
    threads (``PeerOptions.num_worker_threads``, which run the requests), B
    torch intra-op threads (``PeerOptions.intra_op_threads``, 1 on shards by
    default) and C inter-op threads (``PeerOptions.inter_op_threads``: the
    pool on which a large push is applied in parts; a shard's share of the
    cores by default); the default ``1x1x1,1x1x2,2x1x1``: one thread, then
    two applying a push in parts, then two applying pushes.

    Beside them, in this process (1 intra-op thread, as a shard runs):

    (1) the kernel's floor: the step the shard runs, called in-process on
        the same kind of rows: where the shard's optimizer runs on the native
        row kernel (``optim/row_kernel.py``; a build loaded here), one kernel
        call on prebuilt sorted distinct rows, their gradients and state;
        else ``ScriptedOptimizer`` over the functional class
        ``functional_optim_map`` gives, stepped with a COO gradient of R
        sorted distinct rows marked coalesced, as the shard builds a push's
        (``optim_step.py`` case (d)); for lookups ``torch.index_select``;
    (2) the memory floor: the bytes a row update reads and writes (the row,
        its gradient and its state read, the row and its state written:
        3 x 4 x dim + 2 x state bytes, state QHM one row, row-wise Adagrad
        one float; a lookup reads a row and writes it out: 2 x 4 x dim) at
        the copy bandwidth measured in the same run (best ``dst.copy_(src)``
        of 64 MB, 8 bytes per element);
    (3) where a push's time goes, per request, layer by layer, each layer
        called in-process on a table hosted as a shard hosts it: the fused
        step; the shard's compiled step module (``OwnerOptimizer``'s, with
        its gradient checks) on the same gradient; plus building the
        gradient (``optimizers._row_gradient``); ``OwnerOptimizer.apply_rows``
        (its checks, row marks, locks, timing); ``rows.pushes`` (handles,
        unpacking); the ``service.push_lookup`` TorchScript function through
        the ``paramserver::push_lookup`` custom op; and, from the backlog run
        with one shard thread, the shard's CPU per request over RPC.  The
        same for lookups (``index_select``, ``rows.lookup``,
        ``service.lookup``, over RPC).

How to run
    ``.venv/bin/python benchmarks/shard_throughput.py`` (about 3 to 4 minutes
    on 2 busy cores, about 3 GB of memory at dim 128).  ``--quick``: a smoke run of a
    few seconds of timing (a 100,000-row table, R = 1,000, dim 16, QHM, short
    windows).  Options: ``--rows LIST``, ``--dims LIST``, ``--optimizers
    LIST`` (of ``QHM``, ``RowWiseAdagrad``), ``--seconds S`` (timed window
    per measurement, default 0.6), ``--table-rows N``, ``--pushers N``,
    ``--thread-configs LIST``, ``--no-live``, ``--live-all``, ``--profile``
    (a cProfile of in-process ``push_lookup`` calls per case).  Progress goes to stderr, the
    results to stdout as markdown.

How to read it
    Targets, each printed with PASS or BELOW (the script exits 0 either way):

    * rows applied per second over RPC at least 0.7x of the in-process fused
      step, at dims 16 and 64, judged per shard core: rows per second of the
      shard's CPU time, receiving counted (unheld), the first thread
      configuration (one thread); printed beside the ceiling torch RPC's own
      cost sets (the no-op requests);
    * 2 shard threads at least 1.7x of 1 on 2 cores: rows per second of wall
      time, backlog (the pushers idle while the shard works), the best
      two-thread configuration against the first.

    In-process figures are medians of the CPU time of one request per sample
    (this thread's: time other processes take is not counted, as it is not
    in the shard's CPU time), the layers interleaved; RPC figures are totals
    over their window.  On a shared
    machine other processes take cores too: compare runs, not digits.
"""

import argparse
import datetime
import gc
import glob
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from paramserver.optim import QHM, RowWiseAdagrad
from paramserver.optim.registry import functional_optim_map
from paramserver.optim.row_kernel import Rounding
from paramserver.optim.scripted import ScriptedOptimizer
from rpc_floor import push_floor

FLOAT_BYTES = 4
ID_BYTES = 8
STREAM_COPY_NUMEL = 16 * 1024 * 1024  # 64 MB per tensor: DRAM, not cache
COPY_BYTES_PER_ELEMENT = 8  # read src, write dst
TARGET_VS_IN_PROCESS = 0.7
TARGET_DIMS = (16, 64)
TARGET_TWO_THREADS = 1.7
BACKLOG_BYTES_PER_PUSHER = 64 * 2**20
BACKLOG_REQUESTS = (8, 1000)  # per pusher, at least and at most
LIVE_IN_FLIGHT = 4  # requests each pusher keeps in flight in the live mode
GRADIENT_SETS = 4  # distinct gradient tensors each pusher cycles through
SHARD = "shard0"
WARMUP_CALLS = 3


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer of the benchmark: its class, hyperparameters, and its state per row."""

    name: str
    cls: type
    kwargs: Dict[str, float]
    state_rows: int  # float32 state tensors shaped like the table
    state_floats: int  # float32 state values per row besides those

    def bytes_per_row(self, dim: int) -> int:
        """Read the row, its gradient and its state; write the row and its state."""
        row = FLOAT_BYTES * dim
        return 3 * row + 2 * (self.state_rows * row + FLOAT_BYTES * self.state_floats)


OPTIMIZERS = {
    "QHM": OptimizerSpec("QHM", QHM, dict(lr=0.01, momentum=0.9, nu=0.7), 1, 0),
    "RowWiseAdagrad": OptimizerSpec("RowWiseAdagrad", RowWiseAdagrad, dict(lr=0.01, eps=1e-8), 0, 1),
}


def lookup_bytes_per_row(dim: int) -> int:
    """A lookup reads the row and writes it into the reply."""
    return 2 * FLOAT_BYTES * dim


def progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def row_sets(table_rows: int, rows: int, seed: int) -> torch.Tensor:
    """Disjoint sets of ``rows`` sorted random rows of the table (as many as fit, at most 256), one per row."""
    sets = max(1, min(256, table_rows // rows))
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(table_rows, generator=generator)[:sets * rows].view(sets, rows).sort(1).values


# --------------------------------------------------------------------------
# In this process: the floors and the layers of a request
# --------------------------------------------------------------------------

def copy_gbps(seconds: float) -> float:
    """Best bandwidth of ``dst.copy_(src)`` over 64 MB float32 tensors within ``seconds`` (at least 5 copies)."""
    src, dst = torch.randn(STREAM_COPY_NUMEL), torch.empty(STREAM_COPY_NUMEL)
    best, deadline, calls = float("inf"), time.perf_counter() + seconds, 0
    while calls < 5 or time.perf_counter() < deadline:
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
        calls += 1
    return STREAM_COPY_NUMEL * COPY_BYTES_PER_ELEMENT / best / 1e9


def time_layers(layers: Sequence[Tuple[str, Callable[[], None]]], seconds: float, min_rounds: int = 5
                ) -> Dict[str, float]:
    """Median CPU seconds of this thread per call of each layer (CPU time, as the shard's figures are: time
    other processes take from it is not counted): one call each per round, round-robin, each round starting
    one layer further on, until ``seconds`` passed (at least ``min_rounds`` rounds), after a warm-up."""
    for _, call in layers:
        for _ in range(WARMUP_CALLS):
            call()
    samples: Dict[str, List[float]] = {name: [] for name, _ in layers}
    deadline, round_index = time.perf_counter() + seconds, 0
    while round_index < min_rounds or time.perf_counter() < deadline:
        first = round_index % len(layers)
        for name, call in list(layers[first:]) + list(layers[:first]):
            started = time.thread_time_ns()
            call()
            samples[name].append((time.thread_time_ns() - started) * 1e-9)
        round_index += 1
    return {name: statistics.median(values) for name, values in samples.items()}


class Rotation:
    """Takes the next row set (and the next gradient) in turn, whoever asks: consecutive calls touch other rows."""

    def __init__(self, table_rows: int, rows: int, dim: int, seed: int):
        self.sets = row_sets(table_rows, rows, seed)
        generator = torch.Generator().manual_seed(seed + 1)
        self.values = [torch.randn(rows, dim, generator=generator) * 0.01 for _ in range(GRADIENT_SETS)]
        self.next = 0

    def take(self) -> Tuple[torch.Tensor, torch.Tensor]:
        k = self.next
        self.next += 1
        return self.sets[k % len(self.sets)], self.values[k % len(self.values)]


def in_process_case(table_rows: int, rows: int, dim: int, spec: OptimizerSpec, seconds: float,
                    with_lookups: bool) -> Dict[str, float]:
    """Seconds per request of every layer of a push (and of a lookup), in this process, as a shard holds the
    table: its own ``ShardState`` installed in this process's shard service."""
    from paramserver.shards.server import hosted, optimizers, rows as shard_rows, service
    from paramserver.shards.server.state import ShardState

    state = ShardState()
    service.install(state)
    table = hosted.host_rows(state, "table", table_rows, dim, torch.float32, seed=7, start_row=0, shared=True,
                             init_std=0.01)
    owner = optimizers.owner_optimizer_for(state, spec.cls, [table], [0], (), dict(spec.kwargs))
    if hasattr(getattr(owner, "_impl", None), "set_parts"):
        owner._impl.set_parts(1)  # one thread, as the fused step: a push's parts would run on others, unmeasured
    incarnation, (table_handle,) = shard_rows.table_handles(state, [table])
    shape = table.shape
    # The kernel's floor: the functional step on plain storage of the same table, a state of its own.
    fused = ScriptedOptimizer(functional_optim_map[spec.cls], [table.detach()], **spec.kwargs)
    rotation = Rotation(table_rows, rows, dim, seed=11)
    coalesced = [torch.sparse_coo_tensor(ids.unsqueeze(0), rotation.values[k % len(rotation.values)], shape,
                                         check_invariants=True, is_coalesced=True)
                 for k, ids in enumerate(rotation.sets)]
    turn = [0]

    def take_coalesced() -> torch.Tensor:
        turn[0] += 1
        return coalesced[turn[0] % len(coalesced)]

    impl = getattr(owner, "_impl", None)
    row_gradient = getattr(optimizers, "_row_gradient", None)
    step: Callable[[], None] = lambda: fused.step([take_coalesced()])  # noqa: E731
    native = owner._native_rows() if hasattr(owner, "_native_rows") else None
    if native is not None:  # the shard's step is the row kernel's: one call on prebuilt rows, gradients and state
        native.parts = 1  # one thread, as the fused step (its parts would run on other threads, unmeasured)
        native.apply([take_coalesced()], False)  # (its state made)
        kernel_state = native.module.row_state(0)
        plain = Rounding(False, 0, 0, None)  # (float32 rows: no rounding)

        def step() -> None:
            ids, values = rotation.take()
            native.kernel.step(native.update, table, ids, values, kernel_state, native.hyperparameters, plain)
    layers: List[Tuple[str, Callable[[], None]]] = [("step", step)]
    if impl is not None and hasattr(impl, "apply"):
        layers.append(("module", lambda: impl.apply([take_coalesced()], False)))
        if row_gradient is not None:
            def built() -> None:
                ids, values = rotation.take()
                impl.apply([row_gradient(ids, values, list(shape), "table")], False)
            layers.append(("gradient", built))

    def apply_rows() -> None:
        ids, values = rotation.take()
        owner.apply_rows([0], [ids], [values], "bench")

    def pushes() -> None:
        ids, values = rotation.take()
        shard_rows.pushes(state, incarnation, owner.handle, [0], [1], ids, [rows], values.view(-1), "bench", 0, [-1])

    no_ids = torch.empty(0, dtype=torch.long)

    def push_lookup() -> None:  # one table's ids and rows are packed as they are (contiguous): no copy here
        ids, values = rotation.take()
        service.push_lookup(incarnation, owner.handle, [0], [1], ids, [rows], values.view(-1), "bench", 0, [-1], [],
                            no_ids, [], -1)

    layers += [("apply_rows", apply_rows), ("pushes", pushes), ("push_lookup", push_lookup)]
    if with_lookups:
        layers += [
            ("index_select", lambda: torch.index_select(table, 0, rotation.take()[0])),
            ("rows.lookup", lambda: shard_rows.lookup(state, incarnation, [table_handle], rotation.take()[0],
                                                      [rows], -1)),
            ("lookup", lambda: service.lookup(incarnation, [table_handle], rotation.take()[0], [rows], -1)),
        ]
    with torch.no_grad():
        return time_layers(layers, seconds)


def profile_push(table_rows: int, rows: int, dim: int, spec: OptimizerSpec, calls: int) -> str:
    """cProfile of ``calls`` in-process ``service.push_lookup`` calls: the top functions by own time."""
    import cProfile
    import io
    import pstats

    from paramserver.shards.server import hosted, optimizers, rows as shard_rows, service
    from paramserver.shards.server.state import ShardState

    state = ShardState()
    service.install(state)
    table = hosted.host_rows(state, "table", table_rows, dim, torch.float32, seed=7, start_row=0, shared=True,
                             init_std=0.01)
    owner = optimizers.owner_optimizer_for(state, spec.cls, [table], [0], (), dict(spec.kwargs))
    incarnation, _ = shard_rows.table_handles(state, [table])
    rotation = Rotation(table_rows, rows, dim, seed=13)
    no_ids = torch.empty(0, dtype=torch.long)

    def push() -> None:
        ids, values = rotation.take()
        service.push_lookup(incarnation, owner.handle, [0], [1], ids, [rows], values.view(-1), "bench", 0, [-1], [],
                            no_ids, [], -1)

    for _ in range(WARMUP_CALLS):
        push()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        push()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


# --------------------------------------------------------------------------
# Over RPC: the shard, the driver and the pushers (each a child process)
# --------------------------------------------------------------------------

#: A pusher's requests, made in advance (``prepare``), by what they are for.
_prepared: Dict[str, Dict] = {}
_released = threading.Event()


def hold_until(deadline: float) -> float:
    """Shard side (RPC target): keep this RPC worker thread until ``deadline`` (``time.monotonic``)."""
    time.sleep(max(0.0, deadline - time.monotonic()))
    return time.monotonic()


def release() -> None:
    """Pusher side (RPC target): the driver is done; leave."""
    _released.set()


def prepare(spec: Dict, seed: int) -> int:
    """Pusher side (RPC target): make this pusher's requests for ``spec`` (a table's handles, R, dim) in
    advance; forget earlier ones.  Returns how many row sets it rotates through."""
    from paramserver.shards import wire

    _prepared.clear()
    sets = row_sets(spec["table_rows"], spec["rows"], seed)
    generator = torch.Generator().manual_seed(seed + 1)
    gradients = [wire.pack_rows([torch.randn(spec["rows"], spec["dim"], generator=generator) * 0.01])
                 for _ in range(GRADIENT_SETS)]
    _prepared["ids"] = [wire.pack_ids([ids]) for ids in sets]
    _prepared["gradients"] = gradients
    _prepared["spec"] = spec
    _prepared["next"] = 0
    return len(sets)


def _send_one(kind: str) -> torch.futures.Future:
    """Send the next prepared request of ``kind`` (``push``, ``floor`` or ``lookup``): the arguments of
    ``EmbeddingCollection.send`` (a push with no read; for ``floor`` to ``rpc_floor.push_floor``, which does
    nothing with them) or ``lookup_planned``."""
    import torch.distributed.rpc as rpc

    from paramserver.shards.server import service

    spec, k = _prepared["spec"], _prepared["next"]
    _prepared["next"] = k + 1
    ids = _prepared["ids"][k % len(_prepared["ids"])]
    if kind == "lookup":
        return rpc.rpc_async(SHARD, service.lookup, args=(spec["incarnation"], [spec["table_handle"]], ids,
                                                           [spec["rows"]], k))
    gradients = _prepared["gradients"][k % len(_prepared["gradients"])]
    return rpc.rpc_async(SHARD, push_floor if kind == "floor" else service.push_lookup, args=(
        spec["incarnation"], spec["optimizer_handle"], [spec["param_index"]], [1], ids, [spec["rows"]], gradients,
        spec["peer"], spec["token"], [-1], [], torch.empty(0, dtype=torch.long), [], -1))


def _completion_times(futures: List[torch.futures.Future]) -> List[float]:
    """When each future completed (``time.monotonic``, taken by a callback); raises what a request raised."""
    done: List[float] = []
    for future in futures:
        future.add_done_callback(lambda _: done.append(time.monotonic()))
    for future in futures:
        future.wait()
    while len(done) < len(futures):  # callbacks may run a moment after wait() returns
        time.sleep(0.0005)
    return done


def send_backlog(kind: str, count: int, start: float) -> Dict[str, float]:
    """Pusher side (RPC target): from ``start`` on, send ``count`` prepared requests at once, then wait for
    every reply.  Returns when the last one left and when the last reply came."""
    time.sleep(max(0.0, start - time.monotonic()))
    futures = [_send_one(kind) for _ in range(count)]
    last_sent = time.monotonic()
    done = _completion_times(futures)
    return {"count": count, "last_sent": last_sent, "last_done": max(done)}


def send_live(kind: str, start: float, end: float, in_flight: int) -> Dict[str, float]:
    """Pusher side (RPC target): from ``start`` to ``end``, keep ``in_flight`` requests in flight.  Returns
    how many were answered by ``end``."""
    time.sleep(max(0.0, start - time.monotonic()))
    pending: List[torch.futures.Future] = []
    done: List[float] = []
    while time.monotonic() < end:
        while len(pending) < in_flight:
            future = _send_one(kind)
            future.add_done_callback(lambda _: done.append(time.monotonic()))
            pending.append(future)
        pending.pop(0).wait()
    for future in pending:
        future.wait()
    return {"count": sum(1 for when in done if when <= end)}


def pusher(timeout_s: float) -> None:
    """A pusher process: answer the driver's RPCs (``prepare``, ``send_*``) until it calls ``release``."""
    if not _released.wait(timeout_s):
        raise TimeoutError(f"the driver did not release this pusher within {timeout_s:.0f} s")


def shard_cpu_seconds(pid: int) -> float:
    """CPU seconds every thread of process ``pid`` ran so far (``schedstat``: nanoseconds, not clock ticks)."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as stat:
                total += int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just ended
            pass
    return total * 1e-9


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


class Driver:
    """The driver (trainer0): makes each table and its optimizer on the shard as a trainer does, tells the
    pushers what to send and when, and reads the shard's CPU time around each window."""

    def __init__(self, pushers: Sequence[str], rpc_threads: int, config: Dict):
        import torch.distributed.rpc as rpc

        self.rpc = rpc
        self.pushers, self.rpc_threads, self.config = list(pushers), rpc_threads, config
        self.shard_pid = rpc.rpc_sync(SHARD, os.getpid)
        self.hold = 0.2  # seconds the shard's threads are held while the backlog is sent; grows when too short

    def on_pushers(self, function, args_of: Callable[[int], tuple]) -> List:
        futures = [self.rpc.rpc_async(name, function, args=args_of(k)) for k, name in enumerate(self.pushers)]
        return [future.wait() for future in futures]

    def backlog(self, kind: str, count: int, seconds: float) -> Dict[str, float]:
        """Cycles of held shard threads, a backlog sent, and its drain, until ``seconds`` of drain were timed."""
        rows = self.config["spec"]["rows"]
        total = {"requests": 0, "wall": 0.0, "cpu": 0.0, "cycles": 0}
        attempts = 0
        while total["wall"] < seconds or total["cycles"] < 2:
            attempts += 1
            if attempts > 50:
                raise RuntimeError(f"could not time a {kind} backlog within 50 cycles")
            start = time.monotonic() + 0.02
            deadline = start + self.hold
            holds = [self.rpc.rpc_async(SHARD, hold_until, args=(deadline,)) for _ in range(self.rpc_threads)]
            sends = [self.rpc.rpc_async(name, send_backlog, args=(kind, count, start)) for name in self.pushers]
            busy_until = self.held_until_idle(deadline)
            cpu_before = shard_cpu_seconds(self.shard_pid)
            answers = [future.wait() for future in sends]
            cpu = shard_cpu_seconds(self.shard_pid) - cpu_before
            for future in holds:
                future.wait()
            if max(answer["last_sent"] for answer in answers) > deadline - 0.005 or busy_until > deadline - 0.03:
                self.hold *= 2  # the backlog was still leaving or arriving: not all of it waited
                continue
            total["requests"] += sum(answer["count"] for answer in answers)
            total["wall"] += max(answer["last_done"] for answer in answers) - deadline
            total["cpu"] += cpu
            total["cycles"] += 1
        total["rows"] = total["requests"] * rows
        return total

    def unheld(self, kind: str, count: int, seconds: float) -> Dict[str, float]:
        """The pushers send ``count`` requests each at once, the shard's threads not held, until ``seconds`` were
        timed (at least two rounds).  Only the shard's CPU per request is read from it, which holding its threads
        does not change; its wall time includes the pushers' sending."""
        total = {"requests": 0, "wall": 0.0, "cpu": 0.0, "cycles": 0}
        while total["wall"] < seconds or total["cycles"] < 2:
            start = time.monotonic() + 0.02
            cpu_before = shard_cpu_seconds(self.shard_pid)
            answers = self.on_pushers(send_backlog, lambda k: (kind, count, start))
            total["cpu"] += shard_cpu_seconds(self.shard_pid) - cpu_before
            total["wall"] += max(answer["last_done"] for answer in answers) - start
            total["requests"] += sum(answer["count"] for answer in answers)
            total["cycles"] += 1
        total["rows"] = total["requests"] * self.config["spec"]["rows"]
        return total

    def held_until_idle(self, deadline: float) -> float:
        """Sleep until ``deadline``, reading the shard's CPU time every 10 ms; the last moment it was still
        working (its RPC threads are held: receiving the backlog), so that a backlog still arriving at the
        deadline is not counted."""
        busy_until, last = 0.0, shard_cpu_seconds(self.shard_pid)
        while time.monotonic() < deadline - 0.01:
            time.sleep(0.01)
            now = shard_cpu_seconds(self.shard_pid)
            if now - last > 0.001:
                busy_until = time.monotonic()
            last = now
        sleep_until(deadline)
        return busy_until

    def live(self, kind: str, seconds: float) -> Dict[str, float]:
        """Every pusher keeps requests in flight for ``seconds``; the shard's CPU read around the window."""
        start = time.monotonic() + 0.05
        end = start + seconds
        sends = [self.rpc.rpc_async(name, send_live, args=(kind, start, end, LIVE_IN_FLIGHT))
                 for name in self.pushers]
        sleep_until(start)
        cpu_before = shard_cpu_seconds(self.shard_pid)
        sleep_until(end)
        cpu = shard_cpu_seconds(self.shard_pid) - cpu_before
        requests = sum(future.wait()["count"] for future in sends)
        return {"requests": requests, "wall": seconds, "cpu": cpu, "rows": requests * self.config["spec"]["rows"],
                "cycles": 1}


def backlog_count(rows: int, dim: int) -> int:
    """Requests per pusher in a backlog: 64 MB of pushes, within ``BACKLOG_REQUESTS``."""
    request_bytes = rows * (ID_BYTES + FLOAT_BYTES * dim)
    low, high = BACKLOG_REQUESTS
    return max(low, min(high, BACKLOG_BYTES_PER_PUSHER // request_bytes))


def driver(pushers: Sequence[str], rpc_threads: int, plan: Dict, out_path: str) -> None:
    """The driver process (trainer0): every case of ``plan`` against the shard; figures to ``out_path``."""
    import torch.distributed.rpc as rpc

    from paramserver.optim import DistributedOptimizer
    from paramserver.shards import EmbeddingCollection, ShardedEmbeddingBag

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    me = rpc.get_worker_info().name
    figures: List[Dict] = []
    try:
        config = {}
        run = Driver(pushers, rpc_threads, config)
        label = plan["label"]
        for dim in plan["dims"]:
            for optimizer_index, name in enumerate(plan["optimizers"]):
                spec = OPTIMIZERS[name]
                bag = ShardedEmbeddingBag(plan["table_rows"], dim, "sum", shards=[SHARD], seed=7, init_std=0.01)
                optimizer = DistributedOptimizer(spec.cls, bag.remote_parameters(), **spec.kwargs)
                collection = EmbeddingCollection({"table": bag}, optimizer.owner_layout(), me)
                _, slot = collection.where("table", 0)
                for rows in plan["rows"]:
                    config["spec"] = dict(incarnation=collection.incarnation(SHARD), table_handle=slot.table_handle,
                                          optimizer_handle=collection.optimizer_handle(SHARD),
                                          param_index=slot.param_index, table_rows=plan["table_rows"], rows=rows,
                                          dim=dim, peer=me, token=collection.token)
                    run.on_pushers(prepare, lambda k: (config["spec"], 100 + k))
                    kinds = ["push"] + (["floor", "lookup"] if optimizer_index == 0 else [])
                    for kind in kinds:
                        count = backlog_count(rows, dim)
                        entry = dict(rows=rows, dim=dim, optimizer=name, kind=kind, threads=label)
                        if kind != "floor":
                            entry["backlog"] = run.backlog(kind, count, plan["seconds"])
                        if kind != "lookup":  # (receiving counted: a push's, and the no-op's it is set against)
                            entry["unheld"] = run.unheld(kind, count, plan["seconds"])
                        if plan["live"] and kind != "floor":
                            entry["live"] = run.live(kind, plan["seconds"])
                        figures.append(entry)
                        b = entry.get("backlog", entry.get("unheld"))
                        progress("  shard {}: R={:,} dim {} {} {}: backlog {:,.0f} rows/s wall, {:,.0f} per shard "
                                 "CPU s ({:.2f} cores){}".format(
                                     label, rows, dim, name if kind == "push" else "", kind, b["rows"] / b["wall"],
                                     b["rows"] / max(b["cpu"], 1e-9), b["cpu"] / b["wall"],
                                     "; live {:,.0f} rows/s".format(entry["live"]["rows"] / entry["live"]["wall"])
                                     if "live" in entry else ""))
                del collection, optimizer, bag
                gc.collect()
    finally:
        for name in pushers:
            try:
                rpc.rpc_sync(name, release)
            except RuntimeError:
                pass
    with open(out_path, "w") as out:
        json.dump(figures, out)


def parse_threads(text: str) -> Tuple[int, int, Optional[int]]:
    """``AxB`` or ``AxBxC``: RPC worker threads, intra-op threads, inter-op threads (``None``: torch's default)."""
    numbers = [int(part) for part in text.split("x")]
    if not 1 <= len(numbers) <= 3 or min(numbers) < 1:
        raise ValueError(f"a thread configuration is AxB or AxBxC of positive numbers, got {text!r}")
    numbers += [1, None][len(numbers) - 1:]
    return numbers[0], numbers[1], numbers[2]


def over_rpc(args, label: str, timeout_s: float) -> List[Dict]:
    """One shard server with ``label``'s threads, ``args.pushers`` pushers and the driver: its figures."""
    from paramserver.shards.local import run_local_cluster
    from paramserver.shards.peer import PeerOptions
    from paramserver.shards.server.process import ShardServerOptions

    rpc_threads, intra, inter = parse_threads(label)
    pushers = [f"trainer{k + 1}" for k in range(args.pushers)]
    plan = dict(label=label, dims=args.dims, optimizers=args.optimizers, rows=args.rows,
                table_rows=args.table_rows, seconds=args.seconds,
                live=not args.no_live and (label == args.thread_configs[0] or args.live_all))
    shard_options = ShardServerOptions(peer=PeerOptions(num_worker_threads=rpc_threads, intra_op_threads=intra,
                                                        inter_op_threads=inter, transports=("uv",)))
    trainer_options = PeerOptions(transports=("uv",))
    with tempfile.TemporaryDirectory() as directory:
        out_path = os.path.join(directory, "figures.json")
        trainers = [(driver, (pushers, rpc_threads, plan, out_path))] + [(pusher, (timeout_s,)) for _ in pushers]
        run_local_cluster(trainers, num_shards=1, timeout=datetime.timedelta(seconds=timeout_s),
                          shard_options=shard_options, trainer_options=trainer_options)
        with open(out_path) as figures:
            return json.load(figures)


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "PASS" if ok else "BELOW"


def rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    return f"{value / 1e3:.0f}k"


def per_cpu(figure: Dict) -> float:
    return figure["rows"] / max(figure["cpu"], 1e-9)


def per_wall(figure: Dict) -> float:
    return figure["rows"] / figure["wall"]


def request_cpu(figure: Optional[Dict], key: str = "unheld") -> Optional[float]:
    """The shard's CPU seconds per request of a case's ``key`` measurement (``None`` without one)."""
    if figure is None or key not in figure:
        return None
    return figure[key]["cpu"] / figure[key]["requests"]


def received(layers: Dict[str, float], push_figure: Optional[Dict], floor_figure: Optional[Dict]) -> str:
    """Pushes with the shard's receiving counted (``unheld``), as x of the in-process fused step per shard CPU
    second, and the ceiling torch RPC sets there: the step alone against the step plus a no-op request's CPU
    (``rpc_floor``, the same arguments, receiving counted alike)."""
    push, noop = request_cpu(push_figure), request_cpu(floor_figure)
    if push is None or noop is None:
        return "n/a"
    return f"{layers['step'] / push:.2f}x ({layers['step'] / (layers['step'] + noop):.2f}x)"


def table_start(title: str, header: str, alignment: str) -> None:
    """A blank line, ``title``, a blank line and a markdown table's first two lines."""
    print()
    print(title)
    print()
    print(header)
    print(alignment)


def report(args, gbps: float, local: Dict, rpc_figures: Dict[str, List[Dict]]) -> None:
    first = args.thread_configs[0]
    by_key = {(label, f["rows"], f["dim"], f["optimizer"], f["kind"]): f
              for label, figures in rpc_figures.items() for f in figures}
    print("# Shard throughput: torch {}, {} cores, 1-min load average {:.1f} before, {:.1f} after; table {:,} rows, "
          "{} pushers, {:g} s per window, TCP (uv); shard threads {}; copy {:.1f} GB/s{}".format(
              torch.__version__, os.cpu_count(), args.load_before, os.getloadavg()[0], args.table_rows,
              args.pushers, args.seconds, ", ".join(args.thread_configs), gbps, ", --quick" if args.quick else ""))
    table_start(f"Rows applied per second (pushes), shard threads {first}:",
                "| R | dim | optimizer | bytes/row | memory floor rows/s | in-process fused step rows/s (x of floor) "
                "| drained backlog: over RPC rows/s per shard CPU s | x of in-process | receiving counted: x of "
                "in-process (ceiling) | target | over RPC rows/s wall (shard cores) | live rows/s wall (shard cores) |",
                "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for rows in args.rows:
        for dim in args.dims:
            for name in args.optimizers:
                spec = OPTIMIZERS[name]
                layers = local[(rows, dim, name)]
                fused = rows / layers["step"]
                floor = gbps * 1e9 / spec.bytes_per_row(dim)
                f = by_key.get((first, rows, dim, name, "push"))
                if f is None:
                    continue
                b = f["backlog"]
                whole = request_cpu(f)  # (receiving counted: the target's figure)
                ratio = layers["step"] / whole if whole else per_cpu(b) / fused
                target = f">= {TARGET_VS_IN_PROCESS:g}x {verdict(ratio >= TARGET_VS_IN_PROCESS)}" \
                    if dim in TARGET_DIMS else "(no target)"
                live = f.get("live")
                print("| {:,} | {} | {} | {:,} | {} | {} ({:.2f}x) | {} | {:.2f}x | {} | {} | {} ({:.2f}) | {} |".format(
                    rows, dim, name, spec.bytes_per_row(dim), rate(floor), rate(fused), fused / floor, rate(per_cpu(b)),
                    per_cpu(b) / fused, received(layers, f, by_key.get((first, rows, dim, args.optimizers[0], "floor"))),
                    target,
                    rate(per_wall(b)), b["cpu"] / b["wall"],
                    "{} ({:.2f})".format(rate(per_wall(live)), live["cpu"] / live["wall"]) if live else "n/a"))
    table_start(f"Rows served per second (lookups), shard threads {first}:",
                "| R | dim | bytes/row | memory floor rows/s | in-process index_select rows/s (x of floor) "
                "| over RPC rows/s per shard CPU s | x of in-process | over RPC rows/s wall (shard cores) "
                "| live rows/s wall (shard cores) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        for dim in args.dims:
            name = args.optimizers[0]
            f = by_key.get((first, rows, dim, name, "lookup"))
            layers = local[(rows, dim, name)]
            if f is None or "index_select" not in layers:
                continue
            kernel = rows / layers["index_select"]
            floor = gbps * 1e9 / lookup_bytes_per_row(dim)
            b, live = f["backlog"], f.get("live")
            print("| {:,} | {} | {:,} | {} | {} ({:.2f}x) | {} | {:.2f}x | {} ({:.2f}) | {} |".format(
                rows, dim, lookup_bytes_per_row(dim), rate(floor), rate(kernel), kernel / floor, rate(per_cpu(b)),
                per_cpu(b) / kernel, rate(per_wall(b)), b["cpu"] / b["wall"],
                "{} ({:.2f})".format(rate(per_wall(live)), live["cpu"] / live["wall"]) if live else "n/a"))
    if len(args.thread_configs) > 1:
        print()
        print(f"Shard threads: each configuration's backlog rows/s wall (shard cores) against {first}; live in "
              "brackets after the bar:")
        print()
        print("| R | dim | request | " + " | ".join(args.thread_configs) + " | best / {} | target | best, per shard "
              "CPU s / {} |".format(first, first))
        print("|---:|---:|---|" + "---:|" * len(args.thread_configs) + "---:|---|---:|")
        for rows in args.rows:
            for dim in args.dims:
                for name in args.optimizers + ["lookup"]:
                    kind = "lookup" if name == "lookup" else "push"
                    optimizer = args.optimizers[0] if kind == "lookup" else name
                    figures = [by_key.get((label, rows, dim, optimizer, kind)) for label in args.thread_configs]
                    if any(f is None for f in figures):
                        continue
                    base = figures[0]["backlog"]
                    best = max(figures[1:], key=lambda f: per_wall(f["backlog"]))["backlog"]
                    ratio = per_wall(best) / per_wall(base)
                    cells = []
                    for f in figures:
                        cell = "{} ({:.2f})".format(rate(per_wall(f["backlog"])), f["backlog"]["cpu"] / f["backlog"]["wall"])
                        if "live" in f:
                            cell += " \\| {}".format(rate(per_wall(f["live"])))
                        cells.append(cell)
                    print("| {:,} | {} | {} | {} | {:.2f}x | >= {:g}x {} | {:.2f}x |".format(
                        rows, dim, name if kind == "push" else "lookup", " | ".join(cells), ratio, TARGET_TWO_THREADS,
                        verdict(ratio >= TARGET_TWO_THREADS), per_cpu(best) / per_cpu(base)))
    print()
    print(f"Where a request's time goes, microseconds per request (in-process layers, medians; over RPC: the "
          f"shard's CPU per request, backlog, shard threads {first}):")
    print()
    print("| R | dim | optimizer | fused step | + step module | + gradient built | apply_rows | rows.pushes "
          "| push_lookup op | over RPC | glue in-process | over RPC / fused step | over RPC, receiving counted "
          "| no-op request, receiving counted |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def us(layers: Dict[str, float], key: str) -> str:
        return f"{layers[key] * 1e6:.1f}" if key in layers else "n/a"

    for rows in args.rows:
        for dim in args.dims:
            for name in args.optimizers:
                layers = local[(rows, dim, name)]
                f = by_key.get((first, rows, dim, name, "push"))
                over = request_cpu(f, "backlog")
                noop = request_cpu(by_key.get((first, rows, dim, args.optimizers[0], "floor")))
                whole = request_cpu(f)
                print("| {:,} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1f} | {} | {} | {} |".format(
                    rows, dim, name, us(layers, "step"), us(layers, "module"), us(layers, "gradient"),
                    us(layers, "apply_rows"), us(layers, "pushes"), us(layers, "push_lookup"),
                    f"{over * 1e6:.1f}" if over else "n/a", (layers["push_lookup"] - layers["step"]) * 1e6,
                    f"{over / layers['step']:.2f}x" if over else "n/a", f"{whole * 1e6:.1f}" if whole else "n/a",
                    f"{noop * 1e6:.1f}" if noop else "n/a"))
    name = args.optimizers[0]
    print()
    print("| R | dim | lookup: index_select | rows.lookup | lookup op | over RPC | over RPC / index_select |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        for dim in args.dims:
            layers = local[(rows, dim, name)]
            f = by_key.get((first, rows, dim, name, "lookup"))
            if "index_select" not in layers:
                continue
            over = request_cpu(f, "backlog")
            print("| {:,} | {} | {} | {} | {} | {} | {} |".format(
                rows, dim, us(layers, "index_select"), us(layers, "rows.lookup"), us(layers, "lookup"),
                f"{over * 1e6:.1f}" if over else "n/a", f"{over / layers['index_select']:.2f}x" if over else "n/a"))
    print()
    print(LEGEND.format(target=TARGET_VS_IN_PROCESS, dims=" and ".join(map(str, TARGET_DIMS)),
                        two=TARGET_TWO_THREADS, first=first, in_flight=LIVE_IN_FLIGHT))


LEGEND = """\
Legend: R = distinct sorted rows per request; in-process figures are medians of one request per sample (the
thread's CPU time) with 1 intra-op thread, layers interleaved. Over RPC: pushes are service.push_lookup (one push, no read), lookups
service.lookup, arguments packed as EmbeddingCollection.send packs them. Backlog = the shard's RPC threads
held while the pushers send 64 MB of requests each, then timed from their release to the last reply (the
pushers idle meanwhile); live = each pusher keeps {in_flight} requests in flight (their sending shares the
cores). "per shard CPU s" = rows over the CPU time of every thread of the shard process in the window
(/proc schedstat); "shard cores" = that CPU time / wall time. Memory floor = the copy bandwidth of the run
over bytes/row (push: read row, gradient and state, write row and state; lookup: read the row, write it out).
Layers: "fused step" = the step the shard runs, alone (the kernel's floor): one native row kernel call on
prebuilt rows, gradients and state where the optimizer runs there, else ScriptedOptimizer over the functional
class with a prebuilt coalesced COO gradient; "+ step module" = the OwnerOptimizer's compiled module on the
torch path (gradient checks, then its step); "+ gradient built" = that plus _row_gradient from ids and values; apply_rows = OwnerOptimizer.apply_rows
(checks, row marks, locks, timing); rows.pushes = handles and unpacking too; push_lookup op = the
TorchScript RPC target called in-process (the custom op's Python kernel); over RPC = the shard's CPU per
request (receiving, deserializing, replying included). glue in-process = push_lookup op - fused step.
The backlog's CPU leaves out what the shard spent receiving the requests while its threads were held.
"Receiving counted": the pushers send without the shard's threads held, and the shard's CPU per request counts
everything from the request's arrival; the no-op request is rpc_floor.push_floor sent the pushes' very
arguments (torch RPC's own cost of a push); the ceiling = fused step / (fused step + that no-op's CPU): what a
push over RPC would reach if everything of the shard's own around the step cost nothing.
Targets: rows applied per second over RPC, per shard CPU second (receiving counted), at least {target:g}x of the
in-process fused step at dims {dims} (shard threads {first}); the best two-thread configuration at least {two:g}x of {first}
in backlog rows per second of wall time. Other processes on the machine take cores too (the load average
above): compare runs, not digits."""


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def int_list(text: str) -> List[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def optimizer_list(text: str) -> List[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in OPTIMIZERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(OPTIMIZERS)}, got {text!r}")
    return names


def thread_list(text: str) -> List[str]:
    labels = [part.strip() for part in text.split(",") if part.strip()]
    try:
        for label in labels:
            parse_threads(label)
    except ValueError:
        labels = []
    if not labels:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of AxB or AxBxC (RPC threads x intra-op "
                                         f"threads x inter-op threads), got {text!r}")
    return labels


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Rows one shard process applies and serves per second over RPC, "
                                                 "against the in-process fused step and the memory floor.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: a 100,000-row table, R=1,000, dim 16, QHM, 0.2 s windows")
    parser.add_argument("--rows", type=int_list, default=None, help="distinct rows per request (default 1000,16384)")
    parser.add_argument("--dims", type=int_list, default=None, help="row widths (default 16,64,128)")
    parser.add_argument("--optimizers", type=optimizer_list, default=None,
                        help="of QHM, RowWiseAdagrad (default both)")
    parser.add_argument("--seconds", type=float, default=None, help="timed window per measurement (default 0.6)")
    parser.add_argument("--table-rows", type=int, default=None, help="rows of the table (default 1,000,000)")
    parser.add_argument("--pushers", type=int, default=2, help="pusher processes (default 2)")
    parser.add_argument("--thread-configs", type=thread_list, default=None,
                        help="shard threads to run with, AxBxC = A RPC worker threads x B intra-op threads x C "
                             "inter-op threads (C left out: torch's default) (default 1x1x1,1x1x2,2x1x1; the first "
                             "is the one the other figures use)")
    parser.add_argument("--no-live", action="store_true", help="backlog measurements only")
    parser.add_argument("--live-all", action="store_true",
                        help="the live measurement with every thread configuration (default: the first only)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of in-process push_lookup calls per case")
    args = parser.parse_args(argv)
    args.rows = args.rows or ([1000] if args.quick else [1000, 16384])
    args.dims = args.dims or ([16] if args.quick else [16, 64, 128])
    args.optimizers = args.optimizers or (["QHM"] if args.quick else list(OPTIMIZERS))
    args.seconds = args.seconds or (0.2 if args.quick else 0.6)
    args.table_rows = args.table_rows or (100_000 if args.quick else 1_000_000)
    args.thread_configs = args.thread_configs or ["1x1x1", "1x1x2", "2x1x1"]
    if max(args.rows) > args.table_rows:
        parser.error("--rows must not exceed --table-rows")
    if args.pushers < 1:
        parser.error("--pushers must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    args.load_before = os.getloadavg()[0]
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, message=".*[Ss]parse invariant.*")
    started = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    local_seconds = 0.15 if args.quick else 0.4
    progress("copy bandwidth ...")
    gbps = copy_gbps(0.5 if args.quick else 1.0)
    local: Dict[Tuple[int, int, str], Dict[str, float]] = {}
    for dim in args.dims:
        for index, name in enumerate(args.optimizers):
            for rows in args.rows:
                progress(f"in-process: R={rows:,} dim {dim} {name} ...")
                local[(rows, dim, name)] = in_process_case(args.table_rows, rows, dim, OPTIMIZERS[name],
                                                           local_seconds, with_lookups=index == 0)
                if args.profile:
                    print(f"cProfile of 200 in-process push_lookup calls, R={rows:,} dim {dim} {name}:")
                    print(profile_push(args.table_rows, rows, dim, OPTIMIZERS[name], 200))
            gc.collect()
    rpc_figures = {}
    timeout_s = 600.0
    for label in args.thread_configs:
        progress(f"over RPC: one shard with threads {label}, {args.pushers} pushers ...")
        rpc_figures[label] = over_rpc(args, label, timeout_s)
    report(args, gbps, local, rpc_figures)
    progress(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
