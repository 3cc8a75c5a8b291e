"""The row-wise optimizers' records (``paramserver.optim.records``), in one process: each built-in record says
what its functional class does (its state, its hyperparameter checks, its refusals on rows, its row update);
the docs' table is the records'; and a user's registered optimizer gets a record, with pushes in parts where
its record allows them and in one part otherwise."""

import pathlib
import re
from typing import Dict, List, Optional

import pytest
import torch
from torch import Tensor

from paramserver.jobs import ctr
from paramserver.optim import RowState, RowStep, functional_optim_map, register_functional_optim
from paramserver.optim.kernels import check_gradients, row_slice_fused_min_elements
from paramserver.optim.records import (RowOptimizer, RowRefusal, StateKind, builtin_records, docs_table,
                                       steps_in_parts)
from paramserver.shards.server import ShardState
from paramserver.shards.server.hosted import host_rows
from paramserver.shards.server.optimizers import owner_optimizer_for, split_rows

RECORDS = builtin_records()
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "optimizers.md"


def variants(record: RowOptimizer) -> List[Dict]:
    """The record's example, and the example with each hyperparameter moved off its default (a flag flipped, a
    zero made 0.1): settings that keep other kinds of state, or that the record refuses."""
    found = [dict(record.example)]
    for name, default in record.hyperparameters().items():
        if isinstance(default, bool):
            found.append(dict(record.example, **{name: not default}))
        elif isinstance(default, float) and default == 0.0 and name not in record.example:
            found.append(dict(record.example, **{name: 0.1}))
    return found


def sparse_gradient(rows, dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.sparse_coo_tensor(torch.tensor([rows]), torch.randn(len(rows), dim, generator=generator),
                                   (10, dim))


def test_every_built_in_optimizer_has_one_record_and_the_map_and_the_job_read_them():
    assert [record.name for record in RECORDS] == ["QHM", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL"]
    for record in RECORDS:
        for local_cls in record.local:
            assert functional_optim_map[local_cls] is record.functional
            assert functional_optim_map.record_of(local_cls) is record
        assert record.row_update is (record.functional.step_rows if record.rows_independent else
                                     record.functional.step)
        assert not record.rows_independent or steps_in_parts(record.functional)
    assert list(ctr.SPARSE_OPTIMIZERS) == [record.job.name for record in RECORDS]
    assert functional_optim_map.record_of(torch.optim.RMSprop) is None  # PyTorch's: dense parameters only


@pytest.mark.parametrize("record", RECORDS, ids=[record.name for record in RECORDS])
def test_a_records_state_checks_and_refusals_are_its_functional_classs(record):
    """For each setting tried: the record's hyperparameter check refuses what the class refuses; the state it
    declares is the class's ``RowState`` (names, layouts, initial values); its refusal on rows comes exactly
    where the class's row step refuses."""
    refused = 0
    for options in variants(record):
        table = torch.zeros(10, 4)
        try:
            functional = record.functional([table], **options)
        except ValueError as error:
            with pytest.raises(ValueError, match=re.escape(str(error))):
                record.check_hyperparameters((), options)
            continue
        record.check_hyperparameters((), options)
        bound = record.bind((), options)
        assert record.state_for(bound) == (functional.state.names, functional.state.layouts,
                                           [float(value) for value in functional.state.initial]), options
        reason = record.refusal(bound)
        try:
            functional.step([sparse_gradient([1, 3], 4)])
        except ValueError:
            assert reason is not None, f"{record.name} refuses {options} on rows, its record does not"
            refused += 1
        else:
            assert reason is None, f"{record.name}'s record refuses {options} ({reason}); its class takes them"
    assert (refused > 0) == bool(record.refusals)  # a declared refusal was tried, and held


def test_the_docs_table_is_the_records():
    table = docs_table()
    assert table in DOCS.read_text(), f"docs/optimizers.md's table is not the records'; it should read:\n{table}"


# -- a user's own optimizer ---------------------------------------------------------------------------------------

class FunctionalSignRows:
    """A user's row-wise optimizer: sign descent, counting each row's steps; its rows update independently."""

    def __init__(self, params: List[Tensor], lr: float, clip: float = 0.0):
        if lr < 0.0:
            raise ValueError("SignRows: invalid lr={}".format(lr))
        self.params = params
        self.lr = lr
        self.clip = clip
        self.state = RowState("FunctionalSignRows", params, ["count"], ["row"], [0.0])

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        check_gradients("FunctionalSignRows", self.params, gradients)
        with torch.no_grad():
            self.prepare_step(gradients)
            self.step_rows(gradients)

    def prepare_step(self, gradients: List[Optional[Tensor]]) -> None:
        self.state.begin_step(gradients)

    def step_rows(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        with torch.no_grad():
            batch = RowStep(self.state, gradients, True)
            if batch.has_rows() and self.clip != 0.0:
                raise ValueError("FunctionalSignRows: clip={} has no row form".format(self.clip))
            for j in range(len(batch.row_params)):
                batch.row_params[j].add_(batch.row_grads[j].sign(), alpha=-self.lr)
                batch.row_state[0][j].add_(1.0)
            batch.scatter()
            for j in range(len(batch.dense_params)):
                batch.dense_params[j].add_(batch.dense_grads[j].sign(), alpha=-self.lr)
                batch.dense_state[0][j].add_(1.0)
        return batch.row_params + batch.dense_params

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        return self.state.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state.load_state_dict(state)


class FunctionalSignRowsWhole:
    """Sign descent with no ``prepare_step`` / ``step_rows`` to offer: a push is applied in one part."""

    def __init__(self, params: List[Tensor], lr: float, clip: float = 0.0):
        self.params = params
        self.lr = lr
        self.state = RowState("FunctionalSignRowsWhole", params, ["count"], ["row"], [0.0])

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        check_gradients("FunctionalSignRowsWhole", self.params, gradients)
        with torch.no_grad():
            batch = RowStep(self.state, gradients)
            for j in range(len(batch.row_params)):
                batch.row_params[j].add_(batch.row_grads[j].sign(), alpha=-self.lr)
                batch.row_state[0][j].add_(1.0)
            batch.scatter()

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        return self.state.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state.load_state_dict(state)


class SignRows(torch.optim.Optimizer):
    def __init__(self, params, lr, clip=0.0):
        super().__init__(params, dict(lr=lr, clip=clip))


ROWS, DIM, PUSHED = 20_000, 16, 9_000


def push_in_parts(parts: int, **options):
    """Three pushes of ``PUSHED`` rows to a ``SignRows`` table applied in ``parts`` parts: the owner, the table
    and its state."""
    generator = torch.Generator().manual_seed(0)
    state = ShardState()
    table = host_rows(state, f"job.t[0:{ROWS}]", ROWS, DIM, torch.float32, 0, 0, shared=True)
    optimizer = owner_optimizer_for(state, SignRows, [table], [0], (), dict(dict(lr=0.01), **options))
    if parts > 1:
        optimizer._impl.set_parts(parts)
    for step in range(3):
        ids = torch.randperm(ROWS, generator=generator)[:PUSHED].sort().values
        optimizer.apply_rows([0], [ids], [torch.randn(PUSHED, DIM, generator=generator)], "test", (1, step))
    return optimizer, table.detach().clone(), optimizer.state_dict()


def test_a_registered_optimizer_that_steps_in_parts_gets_a_record_and_its_pushes_are_applied_in_parts(restore_map):
    register_functional_optim(SignRows, FunctionalSignRows)
    record = functional_optim_map.record_of(SignRows)
    assert record.name == "SignRows" and record.functional is FunctionalSignRows and record.rows_independent
    assert record.state is None and record.refusals is None  # read from its class: its RowState, a scratch row
    one, one_table, one_state = push_in_parts(1)
    several, several_table, several_state = push_in_parts(3)
    assert one.record is record and hasattr(several._impl, "parts")
    gradient = torch.sparse_coo_tensor(torch.arange(PUSHED).unsqueeze(0), torch.ones(PUSHED, DIM), (ROWS, DIM))
    assert len(split_rows([gradient.coalesce()], 3, row_slice_fused_min_elements())) == 3
    assert torch.equal(one_table, several_table)
    assert torch.equal(one_state[0]["count"], several_state[0]["count"]) and one_state[0]["count"].max() >= 1
    # its refusal on rows, not declared, is tried on a scratch row when the optimizer is made on a table
    with pytest.raises(ValueError, match=r"table 'job.t\[0:20000\]': optimizer SignRows .*clip=0.5 has no row form"):
        push_in_parts(1, clip=0.5)


def test_a_registered_optimizer_whose_record_says_its_rows_are_not_independent_is_applied_in_one_part(restore_map):
    register_functional_optim(SignRows, FunctionalSignRows, record=RowOptimizer(
        name="SignRows", functional=FunctionalSignRows, local=(SignRows,), rows_independent=False,
        state=(StateKind("count", "row"),),
        refusals=(RowRefusal(("clip",), lambda h: h["clip"] != 0.0, "clipping has no row form"),)))
    optimizer, table, state = push_in_parts(1)
    assert not hasattr(optimizer._impl, "parts") and not optimizer.record.rows_independent
    assert state[0]["count"].max() >= 1
    with pytest.raises(ValueError, match=r"optimizer SignRows .*clip=0.5: clipping has no row form"):
        push_in_parts(1, clip=0.5)


def test_a_registered_optimizer_without_step_rows_gets_a_record_without_parts_and_cannot_claim_them(restore_map):
    register_functional_optim(SignRows, FunctionalSignRowsWhole)
    assert not functional_optim_map.record_of(SignRows).rows_independent
    optimizer, table, state = push_in_parts(1)
    assert not hasattr(optimizer._impl, "parts") and state[0]["count"].max() >= 1
    with pytest.raises(TypeError, match=r"SignRows: its record says its rows update independently, but "
                                        r"FunctionalSignRowsWhole has no prepare_step"):
        RowOptimizer(name="SignRows", functional=FunctionalSignRowsWhole, local=(SignRows,), state=None,
                     rows_independent=True)


def test_a_record_whose_state_is_not_its_classs_is_refused_when_a_shard_builds_it(restore_map):
    register_functional_optim(SignRows, FunctionalSignRows, record=RowOptimizer(
        name="SignRows", functional=FunctionalSignRows, local=(SignRows,), state=(StateKind("count", "element"),)))
    with pytest.raises(TypeError, match=r"optimizer SignRows: its record declares the row state .*'element'"):
        push_in_parts(1)
    with pytest.raises(TypeError, match="dense parameters only"):
        register_functional_optim(SignRows, FunctionalSignRows, rows=False,
                                  record=functional_optim_map.record_of(SignRows))
