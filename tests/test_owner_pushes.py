"""The owner's side of a push, in one process (``OwnerOptimizer.apply_rows``): the rows pushed are stepped as
a dense step of the sub-table made of them would step them, whatever order they come in, and a push naming a
row its parameter does not have is refused, naming both, with nothing changed."""

import pytest
import torch

from paramserver.optim import QHM, functional_optim_map
from paramserver.shards.server.optimizers import OwnerOptimizer
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
