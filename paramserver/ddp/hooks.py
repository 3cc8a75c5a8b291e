"""DDP comm hooks by name: how a trainer group averages its gradients.

Owns the registry of hooks a trainer group may use (``HOOK_NAMES``),
``comm_hook(name, process_group, **options)`` which builds a hook and its
state, our implementations of those hooks, and the measured byte count of
every all-reduce they issue.  Does not own forming the group or wrapping the
model in DDP (``paramserver.ddp.group``), nor checkpoint files (a checkpoint
pickles the state, or stores its ``state_dict()``).

The hooks (each returns averages, like plain all-reduce):

``allreduce``          the bucket, all-reduced in its own dtype.
``fp16`` / ``bf16``    the bucket cast to float16 / bfloat16, pre-divided by the
                       world size, all-reduced, cast back into the bucket.
``powersgd``           PowerSGD (Vogels et al. 2019), layer by layer, as torch's
                       ``powerSGD_hook``: each gradient matrix n x m worth it
                       (``n*m >= min_compression_rate * (n+m) * rank``) is sent as
                       P (n x rank) and Q (m x rank); 1-D tensors and matrices not
                       worth it are all-reduced uncompressed, together.  Plain
                       all-reduce before step ``start_powerSGD_iter``.
``batched_powersgd``   PowerSGD on the whole bucket viewed as one square matrix
                       padded with zeros (as torch's ``batched_powerSGD_hook``),
                       for any bucket size; a bucket too small to be worth it is
                       all-reduced plainly.
``fp16_powersgd``, ``bf16_powersgd``, ``fp16_batched_powersgd``,
``bf16_batched_powersgd``
                       the bucket cast to low precision, PowerSGD on that, the
                       result cast back (torch's ``fp16_compress_wrapper``).
``noop``               sends nothing and returns the local gradient unchanged:
                       for measuring compute without communication (replicas
                       drift apart).

Why our own implementations, on torch 2.13 (CPU build):
    * gloo all-reduces float16 and bfloat16 tensors correctly; but
      ``DistributedDataParallel.register_comm_hook`` refuses any hook *named*
      ``bf16_compress_hook`` or ``bf16_compress_wrapper_hook`` unless torch
      was built with CUDA and NCCL >= 2.10 (or XPU), whatever the backend.
      Our hooks carry their own names and work on gloo and NCCL alike.
    * ``batched_powerSGD_hook`` hands its 2-D Q (side x rank) to
      ``_orthogonalize``, which since torch batched the layer-wise hook
      asserts a 3-D batch of matrices: it raises AssertionError on the first
      compressed step for any model, small or large.  (A bucket smaller than
      ``rank**2`` elements would break the same assertion, rank > side.)
      Here the rank is capped by the matrix's sides.

Collective order: every all-reduce is issued during the hook call itself,
which DDP makes bucket by bucket in the same order on every rank; never from
a future's callback, whose order across buckets differs between ranks (and
would pair one rank's P with another rank's Q).  So PowerSGD waits for its
small P and Q all-reduces inside the hook; the bucket's last all-reduce
(the uncompressed tensors, or the whole bucket) overlaps with the rest of
backward.  Every tensor a hook creates takes the bucket's device and dtype,
so the hooks run on NCCL/CUDA as on gloo/CPU.

Bytes are measured, not assumed: every all-reduce goes through
``CommHookState.all_reduce``, which adds ``numel * element_size`` of the
tensor actually sent; a step closes on the bucket DDP reports as last, and
its bytes go to the state's ``recorder`` when it was handed one (a
``HookRecorder``: the worker's training metrics, when it serves them).

Checkpoints: a state pickles without its process group and its recorder;
after unpickling, ``state.attach(group, recorder)`` (or nothing: ``None``
means the default group, and no recorder),
register it on the new DDP model and training goes on with the restored step
counter and PowerSGD's error and Q memory.  ``state_dict()`` /
``load_state_dict()`` do the same with a plain dict.  The first backward
after a restore is a plain all-reduce that leaves the memory alone: a new
DDP model's first backward uses buckets in another order than the later
ones (DDP rebuilds them after it), and the memory belongs to the later ones.
"""

import logging
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


class HookRecorder(Protocol):
    """What a comm hook's state records (``paramserver.metrics.training.TrainingMetrics`` has it): one call per
    completed backward pass, with the bytes handed to all-reduce in it."""

    def hook_step(self, hook: str, step_bytes: int) -> None: ...


class CommHookState:
    """A hook's process group and the bytes it sent.

    ``steps`` counts completed backward passes (a step closes on the bucket
    DDP reports as last); ``last_step_bytes`` is the payload handed to
    all-reduce in the last completed step, all buckets together;
    ``total_bytes`` everything so far; ``steps_since_restore`` the steps
    since this object was built, unpickled or loaded.  ``recorder``: where
    each completed step's bytes are counted too (``None``: nowhere).

    Pickling drops the process group and the recorder (nothing else is tied
    to the process); after unpickling call ``attach(group, recorder)``, or
    leave it: ``None`` means the default group, and no recorder.
    """

    def __init__(self, hook_name: str, process_group: Optional[dist.ProcessGroup] = None,
                 recorder: Optional[HookRecorder] = None):
        self.hook_name = hook_name
        self.process_group = process_group
        self.recorder = recorder
        self.steps = 0
        self.total_bytes = 0
        self.last_step_bytes = 0
        self.steps_since_restore = 0
        self._open_step_bytes = 0

    def attach(self, process_group: Optional[dist.ProcessGroup] = None,
               recorder: Optional[HookRecorder] = None) -> "CommHookState":
        """Use ``process_group`` (``None``: the default group) and record to ``recorder`` (``None``: nowhere)
        from now on; returns self."""
        self.process_group, self.recorder = process_group, recorder
        return self

    @property
    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """Start summing ``tensor`` in place across the group, counting the bytes sent."""
        sent = tensor.numel() * tensor.element_size()
        self._open_step_bytes += sent
        self.total_bytes += sent
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def end_bucket(self, bucket: dist.GradBucket) -> None:
        """Called by the hook once a bucket's all-reduces are issued; the last bucket closes the step."""
        if bucket.is_last():
            self.last_step_bytes, self._open_step_bytes = self._open_step_bytes, 0
            self.steps += 1
            self.steps_since_restore += 1
            if self.recorder is not None:
                self.recorder.hook_step(self.hook_name, self.last_step_bytes)

    def options(self) -> Dict[str, Any]:
        """The options this hook was built with (none for the plain hooks)."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        """Counters (and a subclass's memory) as plain values and tensor copies."""
        return {"hook": self.hook_name, "options": self.options(), "steps": self.steps,
                "total_bytes": self.total_bytes, "last_step_bytes": self.last_step_bytes}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, from a state of the same hook and options."""
        if state["hook"] != self.hook_name or state["options"] != self.options():
            raise ValueError(f"state of comm hook {state['hook']!r} with options {state['options']} cannot be "
                             f"loaded into comm hook {self.hook_name!r} with options {self.options()}")
        self.steps, self.total_bytes = state["steps"], state["total_bytes"]
        self.last_step_bytes, self._open_step_bytes = state["last_step_bytes"], 0
        self.steps_since_restore = 0

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "process_group": None, "recorder": None}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, recorder=None, steps_since_restore=0, _open_step_bytes=0)


#: Our earlier names of PowerSGD's options, still accepted: alias -> torch's ``PowerSGDState`` name.
POWERSGD_ALIASES = {"rank": "matrix_approximation_rank", "start_iter": "start_powerSGD_iter",
                    "error_feedback": "use_error_feedback", "seed": "random_seed"}


@dataclass(frozen=True)
class PowerSGDOptions:
    """PowerSGD's options: torch's ``PowerSGDState`` names, meanings and defaults.

    ``matrix_approximation_rank``: of the approximation (capped by each
    matrix's sides).  ``start_powerSGD_iter``: plain all-reduce for steps
    before it; at least 2 with error feedback or warm start, since DDP
    rebuilds its buckets after the first backward.  ``min_compression_rate``:
    compress an n x m matrix only if ``n*m >= min_compression_rate * (n+m) *
    rank``.  ``use_error_feedback``: add what compression lost last step to
    this step's gradient.  ``warm_start``: start from last step's Q instead of
    a random one.  ``orthogonalization_epsilon``: added to each column's norm
    when orthogonalizing by Gram-Schmidt (ranks 1 and 2), as torch's; 0
    divides by the norm alone (a zero column stays zero).
    ``random_seed``: of the random Qs, the same on every rank.
    ``batch_tensors_with_same_shape``: compress the bucket's matrices of one
    shape together, in batched products (the result is the same).
    ``POWERSGD_ALIASES`` are accepted for the names they map to (not both).
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1000
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    random_seed: int = 0
    batch_tensors_with_same_shape: bool = False

    def __post_init__(self):
        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value):
            return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0

        problems = []
        if not is_int(self.matrix_approximation_rank) or self.matrix_approximation_rank < 1:
            problems.append(f"matrix_approximation_rank must be an int >= 1, got {self.matrix_approximation_rank!r}")
        if not is_int(self.start_powerSGD_iter) or self.start_powerSGD_iter < 0:
            problems.append(f"start_powerSGD_iter must be an int >= 0, got {self.start_powerSGD_iter!r}")
        elif self.start_powerSGD_iter < 2 and (self.use_error_feedback is True or self.warm_start is True):
            problems.append(f"start_powerSGD_iter must be >= 2 with use_error_feedback or warm_start (DDP rebuilds "
                            f"its buckets after the first backward), got {self.start_powerSGD_iter!r}")
        for name in ("min_compression_rate", "orthogonalization_epsilon"):
            if not is_number(getattr(self, name)):
                problems.append(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        for name in ("use_error_feedback", "warm_start", "batch_tensors_with_same_shape"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not is_int(self.random_seed) or self.random_seed < 0:
            problems.append(f"random_seed must be an int >= 0, got {self.random_seed!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickle options pickled under our earlier names (a checkpoint's hook state) as torch's."""
        defaults = {field.name: field.default for field in fields(self)}
        self.__dict__.update(defaults, **{POWERSGD_ALIASES.get(name, name): value for name, value in state.items()})


def canonical_hook_options(name: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` of comm hook ``name`` with our aliases of PowerSGD's options renamed to torch's names
    (other hooks' options, and unknown names, as given: ``comm_hook`` judges them).  ValueError if an alias
    and the name it stands for are both given."""
    kind = _KINDS.get(name)
    if kind is None or kind.options is not PowerSGDOptions:
        return dict(options)
    both = [f"{alias} and {torch_name}" for alias, torch_name in POWERSGD_ALIASES.items()
            if alias in options and torch_name in options]
    if both:
        raise ValueError(f"comm hook {name!r} got {'; '.join(both)}: the first is an alias of the second, give one")
    return {POWERSGD_ALIASES.get(key, key): value for key, value in options.items()}


GradientLayout = Tuple[Tuple[int, Tuple[int, ...]], ...]  # (offset, shape) of each gradient in a bucket
MatrixShape = Tuple[int, int, int]  # rows, columns, rank of the approximation
MemoryLayout = Tuple[GradientLayout, Tuple[MatrixShape, ...]]


class PowerSGDState(CommHookState):
    """PowerSGD's options and memory, per bucket index.

    ``error_memory[i]``: what compression lost in bucket ``i`` last step
    (error feedback), flat over the bucket's compressed matrices;
    ``q_memory[i]``: last step's Qs (warm start), flat; ``memory_layouts[i]``:
    where the bucket's gradients lay and the (rows, columns, rank) of its
    compressed matrices.  A bucket laid out otherwise than its memory (a
    checkpoint restored into a model bucketed differently) starts afresh,
    with a log line.
    """

    def __init__(self, hook_name: str, process_group: Optional[dist.ProcessGroup], options: PowerSGDOptions,
                 recorder: Optional[HookRecorder] = None):
        super().__init__(hook_name, process_group, recorder)
        self.powersgd_options = options
        self.error_memory: Dict[int, torch.Tensor] = {}
        self.q_memory: Dict[int, torch.Tensor] = {}
        self.memory_layouts: Dict[int, MemoryLayout] = {}

    def options(self) -> Dict[str, Any]:
        return asdict(self.powersgd_options)

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(),
                "error_memory": {i: t.detach().clone() for i, t in self.error_memory.items()},
                "q_memory": {i: t.detach().clone() for i, t in self.q_memory.items()},
                "memory_layouts": dict(self.memory_layouts)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.error_memory = {i: t.detach().clone() for i, t in state["error_memory"].items()}
        self.q_memory = {i: t.detach().clone() for i, t in state["q_memory"].items()}
        self.memory_layouts = dict(state["memory_layouts"])

    def __getstate__(self) -> Dict[str, Any]:
        """As the base's, with the memories on the CPU: a checkpoint's hook state written on a GPU unpickles on
        a host without one (the hook moves a memory to its bucket's device when it uses it)."""
        return {**super().__getstate__(),
                "error_memory": {i: t.cpu() for i, t in self.error_memory.items()},
                "q_memory": {i: t.cpu() for i, t in self.q_memory.items()}}

    def compressing(self) -> bool:
        """Whether this step compresses (see the module's docstring for the step after a restore)."""
        restored_memory = self.steps_since_restore == 0 and (self.error_memory or self.q_memory)
        return self.steps >= self.powersgd_options.start_powerSGD_iter and not restored_memory

    def memory_for(self, bucket_index: int, layout: MemoryLayout) -> None:
        """Keep bucket ``bucket_index``'s memory only if it was made for matrices ``layout``."""
        if self.memory_layouts.get(bucket_index, layout) != layout:
            log.info("comm hook %s: bucket %d is laid out otherwise than its memory; the memory starts afresh",
                     self.hook_name, bucket_index)
            self.error_memory.pop(bucket_index, None)
            self.q_memory.pop(bucket_index, None)
        self.memory_layouts[bucket_index] = layout


class CommHook(NamedTuple):
    """What ``comm_hook`` returns: ``ddp_model.register_comm_hook(*comm_hook(...))``."""

    state: CommHookState
    hook: Hook


# ---------------------------------------------------------------------------------------------
# Reductions: (state, flat tensor, bucket) -> future of the averaged flat tensor.  They issue
# all their all-reduces before returning, through state.all_reduce.


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    """A future already holding ``tensor`` (an accelerator's future must name its device)."""
    future = torch.futures.Future() if tensor.device.type == "cpu" else torch.futures.Future(devices=[tensor.device])
    future.set_result(tensor)
    return future


def _allreduce_mean(state: CommHookState, flat: torch.Tensor, bucket: dist.GradBucket) -> torch.futures.Future:
    flat.div_(state.world_size)  # before the sum, so low precision does not overflow
    return state.all_reduce(flat).get_future().then(lambda future: future.value()[0])


def _keep_local(state: CommHookState, flat: torch.Tensor, bucket: dist.GradBucket) -> torch.futures.Future:
    return _completed(flat)


def _worth_compressing(rows: int, columns: int, rank: int, min_compression_rate: float) -> bool:
    return rows * columns >= min_compression_rate * (rows + columns) * rank


def _orthonormalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalize the columns of ``matrix`` (n x r, r <= n; or a batch of them, k x n x r) in place.

    Gram-Schmidt for r <= 2, as torch's hook, dividing each column by its norm
    plus ``epsilon`` (with 0, a zero column stays zero); QR above.
    Low-precision matrices are orthonormalized in float32 (they are small: P or Q)."""
    if matrix.dim() == 3:
        for one in matrix:
            _orthonormalize(one, epsilon)
        return
    work = matrix if matrix.dtype in (torch.float32, torch.float64) else matrix.float()
    if work.shape[1] > 2:
        work.copy_(torch.linalg.qr(work).Q)
    else:  # Gram-Schmidt, as torch's hook for ranks 1 and 2
        tiny = torch.finfo(work.dtype).tiny
        for i in range(work.shape[1]):
            column = work[:, i:i + 1]
            column.div_(column.norm().clamp_min(tiny) if epsilon == 0 else column.norm() + epsilon)
            if i + 1 < work.shape[1]:
                rest = work[:, i + 1:]
                rest.sub_(column * (column * rest).sum(dim=0, keepdim=True))
    if work is not matrix:
        matrix.copy_(work)


def _random_q(state: PowerSGDState, bucket_index: int, numel: int, like: torch.Tensor) -> torch.Tensor:
    """Fresh random Qs, the same on every rank: seeded by the seed, the step and the bucket."""
    seed = ((state.powersgd_options.random_seed * 1_000_003 + state.steps) * 1_000_033 + bucket_index) % (2 ** 63)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).to(device=like.device, dtype=like.dtype)


def _split(flat: torch.Tensor, shapes: Sequence[Tuple[int, ...]]) -> List[torch.Tensor]:
    views, offset = [], 0
    for shape in shapes:
        views.append(flat[offset:offset + math.prod(shape)].view(shape))
        offset += math.prod(shape)
    return views


def _runs(layout: Sequence[MatrixShape], batch: bool) -> List[Tuple[int, int]]:
    """``(start, stop)`` of the matrices compressed together: each alone, or with ``batch`` each run of
    consecutive matrices of one shape."""
    runs: List[List[int]] = []
    for i, shape in enumerate(layout):
        if batch and runs and layout[runs[-1][0]] == shape:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(start, stop) for start, stop in runs]


def _factor_views(flat: torch.Tensor, layout: Sequence[MatrixShape], runs: Sequence[Tuple[int, int]],
                  side: int) -> List[torch.Tensor]:
    """Views of P (``side`` 0: rows x rank) or Q (``side`` 1: columns x rank) in ``flat``, one per run:
    2-D for a matrix alone, k x n x rank for a run of k."""
    shapes = [(layout[start][side], layout[start][2]) if stop - start == 1
              else (stop - start, layout[start][side], layout[start][2]) for start, stop in runs]
    return _split(flat, shapes)


def _gradient_layout(bucket: dist.GradBucket) -> GradientLayout:
    base = bucket.buffer().storage_offset()
    return tuple((gradient.storage_offset() - base, tuple(gradient.shape)) for gradient in bucket.gradients())


def _compress_in_place(state: PowerSGDState, bucket: dist.GradBucket, matrices: Sequence[torch.Tensor]) -> None:
    """Replace each local matrix by the PowerSGD approximation of its average over the group.

    Issues two all-reduces (all Ps, then all Qs) and waits for them.  With
    ``batch_tensors_with_same_shape`` the matrices are ordered by shape and
    each shape's are multiplied together (stacked: one copy of them)."""
    options = state.powersgd_options
    batch = options.batch_tensors_with_same_shape
    if batch:
        matrices = sorted(matrices, key=lambda m: tuple(m.shape))
    rank = options.matrix_approximation_rank
    layout = tuple((m.shape[0], m.shape[1], min(m.shape[0], m.shape[1], rank)) for m in matrices)
    bucket_index = bucket.index()
    state.memory_for(bucket_index, (_gradient_layout(bucket), layout))
    like = matrices[0]
    if options.use_error_feedback:  # add what was lost last step; keep the sum, to subtract what is sent
        numel = sum(rows * columns for rows, columns, _ in layout)
        error = state.error_memory.get(bucket_index)
        error = like.new_zeros(numel) if error is None else error.to(device=like.device, dtype=like.dtype)
        errors = _split(error, [tuple(m.shape) for m in matrices])
        for matrix, lost in zip(matrices, errors):
            matrix.add_(lost)
            lost.copy_(matrix)
    p_flat = like.new_empty(sum(rows * rank for rows, _, rank in layout))
    q_flat = state.q_memory.get(bucket_index) if options.warm_start else None
    q_numel = sum(columns * rank for _, columns, rank in layout)
    if q_flat is None:
        q_flat = _random_q(state, bucket_index, q_numel, like)
    else:
        q_flat = q_flat.to(device=like.device, dtype=like.dtype)
    runs = _runs(layout, batch)
    ps, qs = _factor_views(p_flat, layout, runs, 0), _factor_views(q_flat, layout, runs, 1)
    ms = [matrices[start] if stop - start == 1 else torch.stack(matrices[start:stop]) for start, stop in runs]
    epsilon = options.orthogonalization_epsilon
    for m, p, q in zip(ms, ps, qs):
        _orthonormalize(q, epsilon)
        torch.matmul(m, q, out=p)
    state.all_reduce(p_flat).wait()  # no need to average: P is orthonormalized
    for m, p, q in zip(ms, ps, qs):
        _orthonormalize(p, epsilon)
        torch.matmul(m.transpose(-2, -1), p, out=q)
    state.all_reduce(q_flat).wait()
    q_flat.div_(state.world_size)
    for (start, stop), m, p, q in zip(runs, ms, ps, qs):
        torch.matmul(p, q.transpose(-2, -1), out=m)
        if stop - start > 1:  # m is a stacked copy
            for matrix, product in zip(matrices[start:stop], m):
                matrix.copy_(product)
    if options.use_error_feedback:
        for matrix, lost in zip(matrices, errors):
            lost.sub_(matrix)
        state.error_memory[bucket_index] = error
    if options.warm_start:
        state.q_memory[bucket_index] = q_flat


def _powersgd_layerwise(state: PowerSGDState, flat: torch.Tensor, bucket: dist.GradBucket) -> torch.futures.Future:
    if not state.compressing():
        return _allreduce_mean(state, flat, bucket)
    options = state.powersgd_options
    matrices, uncompressed = [], []
    for offset, shape in _gradient_layout(bucket):
        view = flat[offset:offset + math.prod(shape)].view(shape)
        if view.dim() >= 2:
            matrix = view.view(view.shape[0], -1)
            rows, columns = matrix.shape
            rank = min(rows, columns, options.matrix_approximation_rank)
            if _worth_compressing(rows, columns, rank, options.min_compression_rate):
                matrices.append(matrix)
                continue
        uncompressed.append(view)
    sent = None
    if uncompressed:  # issued first, so it overlaps with the compression
        together = torch.cat([view.reshape(-1) for view in uncompressed]).div_(state.world_size)
        sent = state.all_reduce(together)
    if matrices:
        _compress_in_place(state, bucket, matrices)
    if sent is None:
        return _completed(flat)

    def unpack(future: torch.futures.Future) -> torch.Tensor:
        reduced, offset = future.value()[0], 0
        for view in uncompressed:
            view.copy_(reduced[offset:offset + view.numel()].view_as(view))
            offset += view.numel()
        return flat

    return sent.get_future().then(unpack)


def _powersgd_batched(state: PowerSGDState, flat: torch.Tensor, bucket: dist.GradBucket) -> torch.futures.Future:
    options = state.powersgd_options
    length = flat.numel()
    side = math.isqrt(length - 1) + 1  # the smallest square holding the bucket
    if (not state.compressing()
            or not _worth_compressing(side, side, min(side, options.matrix_approximation_rank),
                                      options.min_compression_rate)):
        return _allreduce_mean(state, flat, bucket)
    padded = flat.new_zeros(side * side)
    padded[:length] = flat
    _compress_in_place(state, bucket, [padded.view(side, side)])
    flat.copy_(padded[:length])
    return _completed(flat)


# ---------------------------------------------------------------------------------------------
# Hooks: a reduction, optionally in a lower precision, with the step's bookkeeping.


Reduction = Callable[[Any, torch.Tensor, dist.GradBucket], torch.futures.Future]


def _make_hook(name: str, reduce: Reduction, precision: Optional[torch.dtype]) -> Hook:
    def hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        work = buffer if precision is None else buffer.to(precision)
        future = reduce(state, work, bucket)
        state.end_bucket(bucket)
        if work is buffer:
            return future
        return future.then(lambda reduced: buffer.copy_(reduced.value()))

    # DDP logs the hook by name, and refuses torch's bf16 hooks by name off NCCL: ours have their own.
    hook.__name__ = hook.__qualname__ = f"{name}_hook"
    return hook


class _HookKind(NamedTuple):
    reduce: Reduction
    precision: Optional[torch.dtype] = None
    options: Optional[type] = None  # the options dataclass, for hooks that take options


_KINDS: Dict[str, _HookKind] = {
    "allreduce": _HookKind(_allreduce_mean),
    "fp16": _HookKind(_allreduce_mean, torch.float16),
    "bf16": _HookKind(_allreduce_mean, torch.bfloat16),
    "powersgd": _HookKind(_powersgd_layerwise, options=PowerSGDOptions),
    "batched_powersgd": _HookKind(_powersgd_batched, options=PowerSGDOptions),
    "fp16_powersgd": _HookKind(_powersgd_layerwise, torch.float16, PowerSGDOptions),
    "bf16_powersgd": _HookKind(_powersgd_layerwise, torch.bfloat16, PowerSGDOptions),
    "fp16_batched_powersgd": _HookKind(_powersgd_batched, torch.float16, PowerSGDOptions),
    "bf16_batched_powersgd": _HookKind(_powersgd_batched, torch.bfloat16, PowerSGDOptions),
    "noop": _HookKind(_keep_local),
}
_HOOKS: Dict[str, Hook] = {name: _make_hook(name, kind.reduce, kind.precision) for name, kind in _KINDS.items()}

HOOK_NAMES: Tuple[str, ...] = tuple(_KINDS)


def comm_hook(name: str, process_group: Optional[dist.ProcessGroup] = None, *,
              recorder: Optional[HookRecorder] = None, **options: Any) -> CommHook:
    """The hook called ``name`` and a fresh state for it: ``ddp_model.register_comm_hook(state, hook)``.

    ``process_group=None`` means the default group (looked up when the hook
    runs).  ``recorder``: where the state counts each backward pass's bytes
    (``None``: nowhere).  Options (PowerSGD hooks only): see ``PowerSGDOptions``
    (torch's names, or our ``POWERSGD_ALIASES``).  An unknown name, an unknown
    option, an option given twice (an alias and its name) or a bad value raises
    ValueError naming it and what is accepted.
    """
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown comm hook {name!r}; the hooks are: {', '.join(HOOK_NAMES)}")
    accepted = [field.name for field in fields(kind.options)] if kind.options else []
    accepted_text = f"it accepts: {', '.join(accepted)}" if accepted else "it takes no options"
    if kind.options is PowerSGDOptions:
        accepted_text += " (or " + ", ".join(f"{alias} for {name}" for alias, name in POWERSGD_ALIASES.items()) + ")"
    options = canonical_hook_options(name, options)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"comm hook {name!r} got unknown option(s) {', '.join(unknown)}; {accepted_text}")
    if kind.options is None:
        return CommHook(CommHookState(name, process_group, recorder), _HOOKS[name])
    try:
        hook_options = kind.options(**options)
    except ValueError as error:
        raise ValueError(f"comm hook {name!r}: {error}; {accepted_text}") from None
    return CommHook(PowerSGDState(name, process_group, hook_options, recorder), _HOOKS[name])
