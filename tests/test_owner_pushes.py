"""The owner's side of a push, in one process (``OwnerOptimizer.apply_rows``): the rows pushed are stepped as
a dense step of the sub-table made of them would step them, whatever order they come in, and a push naming a
row its parameter does not have is refused, naming both, with nothing changed.  A large push applied in parts
at once gives the rows and state of one step, after a restore too: the parts share nothing they write."""

import dataclasses
import datetime

import pytest
import torch

from paramserver.native import NATIVE_ENV
from paramserver.optim import QHM, FunctionalAdam, RowWiseAdagrad, functional_optim_map, register_functional_optim
from paramserver.optim.kernels import row_slice_fused_min_elements
from paramserver.optim.records import builtin_records
from paramserver.optim.row_sparse import RowState
from paramserver.processes import Child, run_children
from paramserver.shards.server import optimizers as owner_optimizers
from paramserver.shards.server.hosted import host_rows
from paramserver.shards.server.optimizers import OwnerOptimizer, owner_optimizer_for, split_rows
from paramserver.shards.server.state import ShardFault, ShardState

ROWS, DIM = 50, 4
HYPER = dict(lr=0.1, momentum=0.9, nu=0.7)


def owner():
    state = ShardState()
    table = state.shared_table("m.t[0:50]", lambda: torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    return table, OwnerOptimizer(QHM, functional_optim_map[QHM], [table], ["m.t"], (), dict(HYPER), state)


@pytest.mark.parametrize("rows", [[2, 9, 31], [31, 2, 9]], ids=["sorted", "out of order"])
def test_the_rows_pushed_step_as_a_dense_step_of_their_sub_table(rows):
    table, optimizer = owner()
    before = table.clone()
    gradients = [torch.randn(len(rows), DIM, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    for gradient in gradients:
        assert optimizer.apply_rows([0], [torch.tensor(rows)], [gradient], "test")

    sub_table = torch.nn.Parameter(before[rows].clone())
    reference = QHM([sub_table], **HYPER)
    for gradient in gradients:
        sub_table.grad = gradient.clone()
        reference.step()
    torch.testing.assert_close(table[rows], sub_table.detach())
    untouched = [row for row in range(ROWS) if row not in rows]
    assert torch.equal(table[untouched], before[untouched])


@pytest.mark.parametrize("bad", [ROWS, -1])
def test_a_push_naming_a_row_the_parameter_does_not_have_is_refused_and_changes_nothing(bad):
    table, optimizer = owner()
    before = table.clone()
    with pytest.raises(ValueError, match=f"a push names row {bad} of parameter m.t, which has {ROWS} rows"):
        optimizer.apply_rows([0], [torch.tensor([3, bad, 7])], [torch.ones(3, DIM)], "test")
    assert torch.equal(table, before)
    assert optimizer.apply_rows([0], [torch.tensor([3, 7])], [torch.ones(2, DIM)], "test")  # the next push goes in
    assert not torch.equal(table, before)


#: Every optimizer whose pushes are applied in parts (its record's ``rows_independent``), with its record's
#: example settings (which keep every kind of its state).
SPLITTING = [(record.local[0], dict(record.example)) for record in builtin_records() if record.rows_independent]
SPLITTING_IDS = [record.name for record in builtin_records() if record.rows_independent]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("optimizer_cls, options", SPLITTING, ids=SPLITTING_IDS)
def test_a_large_push_applied_in_parts_at_once_gives_the_rows_and_state_of_one_step(optimizer_cls, options, dtype):
    rows, dim, generator = 20_000, 16, torch.Generator().manual_seed(0)
    pushes = [(torch.randperm(rows, generator=generator)[:9_000].sort().values,
               torch.randn(9_000, dim, generator=generator)) for _ in range(3)]
    results = []
    for parts in (1, 3):
        state = ShardState()
        table = host_rows(state, "job.t[0:20000]", rows, dim, dtype, 0, 0, shared=True)
        optimizer = owner_optimizer_for(state, optimizer_cls, [table], [0], (), options)
        optimizer._impl.set_parts(parts)
        for step, (ids, gradients) in enumerate(pushes):
            optimizer.apply_rows([0], [ids], [gradients], "test", (1, step))
        results.append((table.detach().clone(), optimizer.state_dict()))
    gradient = torch.sparse_coo_tensor(pushes[0][0].unsqueeze(0), pushes[0][1], (rows, dim)).coalesce()
    # runs of 48,000 values each, on the fused kernel as the whole; half-precision rows too (their rounding bits
    # are hashed from each row's id)
    assert len(split_rows([gradient], 3, row_slice_fused_min_elements())) == 3
    (one, one_state), (three, three_state) = results
    assert torch.equal(one, three)
    assert one_state.keys() == three_state.keys()
    for index, entry in one_state.items():
        assert all(torch.equal(value, three_state[index][name]) for name, value in entry.items())


class WholeAdam(torch.optim.SparseAdam):
    """A user's class on Adam's functional class, whose record says its rows do not update independently."""


def test_an_optimizer_whose_rows_are_not_independent_applies_a_push_in_one_part(restore_map):
    adam = next(record for record in builtin_records() if record.name == "Adam")
    register_functional_optim(WholeAdam, FunctionalAdam, record=dataclasses.replace(
        adam, name="WholeAdam", local=(WholeAdam,), rows_independent=False, native=None, job=None))
    state = ShardState()
    table = host_rows(state, "job.t[0:100]", 100, DIM, torch.float32, 0, 0, shared=True)
    assert not hasattr(owner_optimizer_for(state, WholeAdam, [table], [0], (), dict(lr=0.1))._impl, "parts")
    for optimizer_cls in (torch.optim.SparseAdam, RowWiseAdagrad):  # (Adam's own record: its step counted once)
        assert owner_optimizer_for(state, optimizer_cls, [table], [0], (), dict(lr=0.1))._impl.parts == \
            torch.get_num_interop_threads()


RESTORED_ROWS, PUSHED_ROWS, RESTORED_DIM = 100_000, 20_000, 16


def restored_owner(optimizer_cls, options, parts: int, dtype: torch.dtype = torch.float32):
    """A table and its optimizer after two pushes, restored into a fresh owner (a restarted shard: QHM's buffers
    loaded unscaled), which applies pushes in ``parts`` parts; and the push that follows."""
    generator = torch.Generator().manual_seed(1)
    pushes = [(torch.randperm(RESTORED_ROWS, generator=generator)[:PUSHED_ROWS].sort().values,
               torch.randn(PUSHED_ROWS, RESTORED_DIM, generator=generator)) for _ in range(3)]

    def owner_of_a_fresh_shard():
        state = ShardState()
        table = host_rows(state, f"job.t[0:{RESTORED_ROWS}]", RESTORED_ROWS, RESTORED_DIM, dtype, 0, 0, shared=True)
        return table, owner_optimizer_for(state, optimizer_cls, [table], [0], (), dict(options))

    table, optimizer = owner_of_a_fresh_shard()
    for step, (ids, gradients) in enumerate(pushes[:2]):
        optimizer.apply_rows([0], [ids], [gradients], "test", (1, step))
    restored_table, restored = owner_of_a_fresh_shard()
    with torch.no_grad():
        restored_table.copy_(table)
    restored.load_state_dict(optimizer.state_dict())
    restored._impl.set_parts(parts)
    return restored_table, restored, pushes[2]


def pushes_after_a_restore_in_parts(interop_threads: int) -> None:
    """Child (its own inter-op pool of ``interop_threads``): for every optimizer that splits, a push after a
    restore applied in one part and in ``interop_threads`` parts at once gives the same rows and state, bit for
    bit, float32 rows and half-precision ones (rounded stochastically in each part)."""
    torch.set_num_interop_threads(interop_threads)
    for optimizer_cls, options, dtype in [(cls, options, dtype) for cls, options in SPLITTING for dtype in
                                          (torch.float32, torch.float16, torch.bfloat16)]:
        results = []
        for parts in (1, interop_threads):
            table, optimizer, (ids, gradients) = restored_owner(optimizer_cls, options, parts, dtype)
            optimizer.apply_rows([0], [ids], [gradients], "test", (1, 2))
            results.append((table.detach().clone(), optimizer.state_dict()))
        gradient = torch.sparse_coo_tensor(ids.unsqueeze(0), gradients, table.shape).coalesce()
        assert len(split_rows([gradient], interop_threads, row_slice_fused_min_elements())) == \
            interop_threads
        (one, one_state), (several, several_state) = results
        assert torch.equal(one, several), f"{optimizer_cls.__name__}, {dtype}: the rows differ by up to " \
            f"{(one.float() - several.float()).abs().max().item()}"
        assert one_state.keys() == several_state.keys()
        for index, entry in one_state.items():
            for name, value in entry.items():
                assert torch.equal(value, several_state[index][name]), f"{optimizer_cls.__name__}: {name} differs"


def test_a_push_after_a_restore_applied_in_parts_on_an_inter_op_pool_gives_the_rows_and_state_of_one_part():
    run_children([Child("owner", pushes_after_a_restore_in_parts, (4,))], datetime.timedelta(seconds=120))


def fields(value):
    """``value``'s Python-level state, comparable: tensors by identity (what they hold is checked by rows)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return [fields(item) for item in value]
    if isinstance(value, dict):
        return {key: fields(item) for key, item in value.items()}
    if isinstance(value, RowState) or hasattr(value, "state") and isinstance(value.state, RowState):
        return {key: fields(item) for key, item in vars(value).items()}
    return value


@pytest.mark.parametrize("optimizer_cls, options", SPLITTING, ids=SPLITTING_IDS)
def test_the_parts_of_a_push_get_disjoint_runs_of_its_rows_and_write_only_those(monkeypatch, optimizer_cls, options):
    """Run eagerly (the parts one after another), each part is watched: it is handed a run of the push's rows,
    and changes those rows of the table and its state and nothing else, no attribute of the optimizer included
    (what a step does once, such as QHM's rescaled momentum after a restore, was done before the parts).  The
    torch path's parts (``PARAMSERVER_NATIVE=0``: no native row kernel)."""
    monkeypatch.setattr(owner_optimizers, "torchscript_enabled", lambda: False)
    monkeypatch.setenv(NATIVE_ENV, "0")
    table, optimizer, (ids, gradients) = restored_owner(optimizer_cls, options, 3)
    functional = optimizer._impl.optim
    step_rows = functional.step_rows
    runs = []

    def watched(pieces):
        (rows,) = [piece._indices()[0] for piece in pieces if piece is not None]
        others = torch.ones(RESTORED_ROWS, dtype=torch.bool)
        others[rows] = False
        watched_tensors = [table] + [tensor for tensor in functional.state.of(0) if tensor.dim() > 0]
        before = fields(functional), [tensor.detach()[others] for tensor in watched_tensors]
        written = step_rows(pieces)
        assert fields(functional) == before[0]
        for tensor, kept in zip(watched_tensors, before[1]):
            assert torch.equal(tensor.detach()[others], kept)
        runs.append(rows)
        return written

    monkeypatch.setattr(functional, "step_rows", watched)
    table_before = table.detach().clone()
    optimizer.apply_rows([0], [ids], [gradients], "test", (1, 2))
    assert len(runs) == 3
    assert torch.equal(torch.cat(sorted(runs, key=lambda run: int(run[0]))), ids)  # consecutive runs, a row in one
    assert not torch.equal(table[ids], table_before[ids])


def test_a_push_that_fails_inside_a_part_after_another_part_wrote_is_a_shard_fault_not_a_refusal(monkeypatch):
    """Out of memory in the second part of a push, after the first wrote its rows: the shard is at fault, not
    the request (a ``ShardFault``, never a ``ValueError``); its process is told once (a shard process ends, to
    be restarted from its newest checkpoint), and until then it applies no push and gives no snapshot, so the
    half-applied rows are never checkpointed or stepped on.  (The torch path's parts: ``PARAMSERVER_NATIVE=0``.)"""
    monkeypatch.setattr(owner_optimizers, "torchscript_enabled", lambda: False)
    monkeypatch.setenv(NATIVE_ENV, "0")
    table, optimizer, (ids, gradients) = restored_owner(QHM, HYPER, 3)
    faults = []
    optimizer._state.on_fault = faults.append
    functional = optimizer._impl.optim
    step_rows = functional.step_rows
    parts = []

    def second_part_runs_out_of_memory(pieces):
        parts.append(pieces)
        if len(parts) == 2:
            raise torch.OutOfMemoryError("CPU out of memory (injected)")
        return step_rows(pieces)

    monkeypatch.setattr(functional, "step_rows", second_part_runs_out_of_memory)
    before = table.detach().clone()
    with pytest.raises(ShardFault, match="failed applying a push.*out of memory"):
        optimizer.apply_rows([0], [ids], [gradients], "test", (1, 2))
    assert not torch.equal(table.detach(), before)  # the first part wrote: half-applied
    assert len(faults) == 1 and "QHM" in faults[0]
    with pytest.raises(ShardFault):
        optimizer.apply_rows([0], [ids], [gradients], "test", (1, 3))
    with pytest.raises(ShardFault):
        optimizer.snapshot()
    assert len(faults) == 1 and len(parts) == 2


def test_the_ledger_names_the_newest_step_applied_per_pusher_and_the_pushes_replayed():
    """What a trainer asks a shard that came back (``OwnerOptimizer.ledger``): the newest step of the pusher
    applied here (-1 for a pusher never seen; a step pushed again is skipped, never lowers it) and how many of
    its pushes the process replayed from its push log."""
    _, optimizer = owner()
    assert optimizer.ledger(1) == (-1, 0)
    for step in (0, 1, 1, 3):
        optimizer.apply_rows([0], [torch.tensor([2, 9])], [torch.ones(2, DIM)], "test", (1, step))
    assert not optimizer.apply_rows([0], [torch.tensor([2])], [torch.ones(1, DIM)], "test", (1, 2))
    optimizer.replayed_pushes[1] = 4  # (filled by the replay of a push log)
    assert optimizer.ledger(1) == (3, 4) and optimizer.ledger(2) == (-1, 0)
