"""The owner's side of a push, in one process (``OwnerOptimizer.apply_rows``): the rows pushed are stepped as
a dense step of the sub-table made of them would step them, whatever order they come in, and a push naming a
row its parameter does not have is refused, naming both, with nothing changed."""

import pytest
import torch

from paramserver.optim import FTRL, QHM, RowWiseAdagrad, functional_optim_map
from paramserver.optim.kernels import row_slice_fused_min_elements
from paramserver.shards.server.hosted import host_rows
from paramserver.shards.server.optimizers import OwnerOptimizer, owner_optimizer_for, split_rows
from paramserver.shards.server.state import ShardState

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("optimizer_cls, options", [
    (QHM, HYPER), (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)), (RowWiseAdagrad, dict(lr=0.1)),
    (FTRL, dict(lr=0.5, l1=0.001))], ids=["QHM", "SGD", "RowWiseAdagrad", "FTRL"])
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
    assert len(split_rows([gradient], [table], 3, row_slice_fused_min_elements())) == \
        (3 if dtype == torch.float32 else 1)  # runs of 48,000 values each, on the fused kernel as the whole
    (one, one_state), (three, three_state) = results
    assert torch.equal(one, three)
    assert one_state.keys() == three_state.keys()
    for index, entry in one_state.items():
        assert all(torch.equal(value, three_state[index][name]) for name, value in entry.items())


def test_an_optimizer_with_a_count_over_the_table_applies_a_push_in_one_part():
    state = ShardState()
    table = host_rows(state, "job.t[0:100]", 100, DIM, torch.float32, 0, 0, shared=True)
    assert owner_optimizer_for(state, torch.optim.Adagrad, [table], [0], (), dict(lr=0.1))._impl.parts == 1
    assert owner_optimizer_for(state, RowWiseAdagrad, [table], [0], (), dict(lr=0.1))._impl.parts == \
        torch.get_num_interop_threads()
