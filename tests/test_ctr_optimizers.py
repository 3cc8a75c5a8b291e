"""The CTR job's sparse optimizer by name (``paramserver.jobs.ctr.SPARSE_OPTIMIZERS``): one process, no cluster."""

import math

import pytest
import torch

from paramserver.jobs import ctr
from paramserver.optim import QHM
from paramserver.optim.ftrl import FTRL
from paramserver.optim.registry import functional_optim_map
from paramserver.optim.rowwise_adagrad import RowWiseAdagrad
from paramserver.runtime.job import JobConfigError, check_config

JOB = "paramserver.jobs.ctr:main"


def test_each_name_maps_to_its_class():
    assert {name: cls for name, (cls, _) in ctr.SPARSE_OPTIMIZERS.items()} == {
        "qhm": QHM, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad,
        "adam": torch.optim.SparseAdam, "ftrl": FTRL}
    for name, (cls, tuned) in ctr.SPARSE_OPTIMIZERS.items():
        assert ctr.sparse_optimizer_of(name) == (cls, tuned)
        assert cls in functional_optim_map  # the shards have a functional form of it
        assert tuned["lr"] > 0


def test_the_default_is_qhm_as_before():
    assert ctr.sparse_optimizer_of() == (QHM, dict(lr=128.0, momentum=0.9, nu=0.7))
    cls, options = ctr.sparse_optimizer_of("qhm", None, 0.8, 0.5)  # the job's momentum and nu
    assert (cls, options) == (QHM, dict(lr=128.0, momentum=0.8, nu=0.5))


@pytest.mark.parametrize("name", list(ctr.SPARSE_OPTIMIZERS))
def test_sparse_lr_overrides_the_tuned_rate(name):
    cls, options = ctr.sparse_optimizer_of(name, 0.125)
    tuned = dict(ctr.SPARSE_OPTIMIZERS[name][1])
    assert cls is ctr.SPARSE_OPTIMIZERS[name][0]
    assert options == dict(tuned, lr=0.125)
    assert ctr.SPARSE_OPTIMIZERS[name][1]["lr"] == tuned["lr"]  # the table itself is left as it was
    cls, options = ctr.sparse_optimizer_of(name, 3)  # a whole number is a rate too
    assert options["lr"] == 3.0 and isinstance(options["lr"], float)


@pytest.mark.parametrize("name", list(ctr.SPARSE_OPTIMIZERS))
def test_the_shards_optimizer_takes_the_options_and_moves_only_the_touched_rows(name):
    cls, options = ctr.sparse_optimizer_of(name)
    table = torch.nn.EmbeddingBag(10, 4, mode="sum", sparse=True)
    optimizer = functional_optim_map[cls]([table.weight], **options)  # as a shard builds it
    table(torch.tensor([[1, 2], [2, 3]])).sum().backward()
    assert table.weight.grad.is_sparse
    before = table.weight.detach().clone()
    optimizer.step([table.weight.grad])
    moved = (table.weight.detach() != before).any(1)
    assert moved.tolist() == [i in (1, 2, 3) for i in range(10)]


def test_an_unknown_name_is_refused_naming_it_and_the_choices():
    with pytest.raises(ValueError, match=r"sparse_optimizer must be one of qhm, sgd, adagrad, rowwise_adagrad, adam, "
                                         r"ftrl; got 'lamb'"):
        ctr.sparse_optimizer_of("lamb")
    # and before the job is shipped: the config's check names the key, the choices and the value
    with pytest.raises(JobConfigError, match=r"'sparse_optimizer' .*Literal\['qhm', 'sgd', 'adagrad', "
                                             r"'rowwise_adagrad', 'adam', 'ftrl'\], got \"lamb\""):
        check_config(ctr.main, {"sparse_optimizer": "lamb"}, JOB, "--job-config")
    for name in ctr.SPARSE_OPTIMIZERS:
        check_config(ctr.main, {"sparse_optimizer": name, "sparse_lr": 0.5}, JOB, "--job-config")


@pytest.mark.parametrize("lr", [-1.0, 0.0, math.inf, math.nan, "0.1", True])
def test_a_bad_sparse_lr_is_refused_naming_it(lr):
    with pytest.raises(ValueError, match=rf"sparse_lr must be a finite number above 0 .*; got {lr!r}"):
        ctr.sparse_optimizer_of("adam", lr)


def test_a_bad_sparse_lr_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match=r"sparse_lr .*got -2\.0"):
        ctr.build(None, sparse_lr=-2.0)  # no context needed: refused before the data or the tables
    with pytest.raises(ValueError, match=r"sparse_optimizer .*got 'lamb'"):
        ctr.build(None, sparse_optimizer="lamb")
    with pytest.raises(JobConfigError, match=r"'sparse_lr' .*got \"fast\""):
        check_config(ctr.main, {"sparse_lr": "fast"}, JOB, "--job-config")
