"""Which device and backend workers get, with the host's GPUs faked: a GPU of one's own or the CPU, and never two
ranks of an NCCL group on one device (single process: flock conflicts between two open files of one process
as between two processes)."""

import datetime

import pytest
import torch

from paramserver.control.groups import GLOO, NCCL, TrainerGroups
from paramserver.ddp.group import device_for
from paramserver.runtime.devices import claim_gpu


def _form(claims):
    """The backend the coordinator gives a group of workers holding these claims, and each one's device."""
    groups = TrainerGroups(group_size=len(claims), settle=datetime.timedelta(0))
    for rank, claim in enumerate(claims):
        groups.add(0, f"worker{rank}", int(claim.index is not None), now=0.0)
    backend = groups.view(0, now=1.0).backend
    return backend, [device_for(backend, claim.index) for claim in claims]


def test_a_one_gpu_host_gives_one_worker_the_gpu_and_the_group_gloo(tmp_path, caplog):
    caplog.set_level("INFO")
    claims = [claim_gpu(["GPU-one"], str(tmp_path), name=f"worker{i}") for i in range(2)]
    try:
        assert [c.index for c in claims] == [0, None]
        assert "held by another worker" in claims[1].describe()
        assert "its trainer group uses gloo" in caplog.text
        backend, devices = _form(claims)
        assert backend == GLOO and devices == [torch.device("cpu")] * 2
        claims[0].release()  # a worker that ended frees its GPU for the next one
        again = claim_gpu(["GPU-one"], str(tmp_path))
        assert again.index == 0
        again.release()
    finally:
        for claim in claims:
            claim.release()


def test_workers_with_a_gpu_each_get_nccl_on_distinct_devices(tmp_path):
    gpus = ["GPU-a", "GPU-b"]
    claims = [claim_gpu(gpus, str(tmp_path)) for _ in range(2)]
    try:
        backend, devices = _form(claims)
        assert backend == NCCL and devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
        third = claim_gpu(gpus, str(tmp_path))
        assert third.index is None  # outnumbering the GPUs: the CPU, and a gloo group for all three
        assert _form(claims + [third])[0] == GLOO
    finally:
        for claim in claims:
            claim.release()


def test_no_gpu_means_the_cpu_and_nccl_without_a_gpu_is_refused():
    claim = claim_gpu([])
    assert claim.index is None and "no GPU" in claim.describe()
    with pytest.raises(ValueError, match="holds no GPU of its own"):
        device_for(NCCL, None)
