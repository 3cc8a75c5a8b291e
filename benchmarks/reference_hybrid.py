"""The reference of ``benchmarks/end_to_end.py``: the default CTR job written directly against torch RPC + DDP.

Owns the process bodies of the reference run and nothing else; it imports
from ``paramserver`` only the optimizer math (``QHM`` and its functional
form, registered in torch's own ``functional_optim_map``) and from
``workers`` only the model's dense tower and the data, so that both sides
train the same model on the same batches with the same update.  Each
process names itself (``process_cpu.name_this_process``: ``master``,
``psN``, ``trainerN``) so that end_to_end can count its CPU by kind, and
runs the intra-op threads end_to_end gives its role.

The structure is that of PyTorch's tutorial "Combining Distributed
DataParallel with Distributed RPC Framework": a master creates one
``torch.distributed.nn.RemoteModule`` (an ``EmbeddingBag``) per feature on
the parameter servers (whole tables, round-robin) and hands them to the
trainers over RPC; each trainer runs its loop inside that RPC call: a
forward through the remote tables (by RPC, inside a ``dist_autograd``
context) and a DDP-wrapped local dense tower, ``dist_autograd.backward``,
then ``torch.distributed.optim.DistributedOptimizer`` steps the tables' and
the tower's parameters (the tower's as ``RRef``s of local parameters).  It
never touches the framework's data plane, shards or control plane.

The two rendezvous stores (RPC's and the trainers' process group's) are
hosted by the caller (``hosted_stores``), as torchelastic's agent hosts
its workers' (``TORCHELASTIC_USE_AGENT_STORE``), not by a rank: a rank
that hosts a store and finishes ``rpc.shutdown`` first takes the store
away from peers still in its last round ("Connection reset by peer").
"""

import contextlib
import datetime
import json
import os
import pathlib
import statistics
import time
import warnings
from typing import Dict, Iterator, List, Sequence

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.optim import utils as torch_optim_utils
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel

from paramserver.optim import QHM, FunctionalQHM
from process_cpu import name_this_process
from paramserver.jobs.ctr import dense_tower
from paramserver.jobs.ctr_data import CTRSpec, PlantedCTR

# torch's DistributedOptimizer looks the class up in its own map, on the
# trainer that builds it; the owners get the functional class itself.
torch_optim_utils.register_functional_optim(QHM, FunctionalQHM)

NUM_PS = 4
TRAINERS = 2
MASTER = "master"
RPC_TIMEOUT = datetime.timedelta(minutes=5)
#: The kinds of process of the run (``role``).
ROLES = (MASTER, "ps", "trainer")
#: Phases of a reference step whose mean time the trainers report.
PHASES = ("data", "lookups", "dense forward + loss", "backward (DDP allreduce)", "sparse step", "dense step")


def ps_name(index: int) -> str:
    return f"ps{index}"


def trainer_name(rank: int) -> str:
    return f"trainer{rank}"


class CTREmbeddingBag(nn.EmbeddingBag):
    """``nn.EmbeddingBag`` whose rows start N(0, init_std), as the job's tables do (not N(0, 1))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str, sparse: bool, init_std: float,
                 seed: int):
        super().__init__(num_embeddings, embedding_dim, mode=mode, sparse=sparse)
        with torch.no_grad():
            self.weight.normal_(0.0, init_std, generator=torch.Generator().manual_seed(seed))


class HybridModel(nn.Module):
    """The tutorial's model: remote embedding tables, then a DDP-wrapped local dense module."""

    def __init__(self, tables: Sequence[RemoteModule], tower: nn.Module):
        super().__init__()
        self.tables = list(tables)
        self.tower = DistributedDataParallel(tower)

    def lookups(self, ids: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        # All tables at once (the framework's job overlaps its lookups too).
        pending = [table.forward_async(feature_ids) for table, feature_ids in zip(self.tables, ids)]
        return [future.wait() for future in pending]

    def forward(self, pooled: List[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        return self.tower(torch.cat(pooled + [dense], 1))


def run_trainer(tables: Sequence[RemoteModule], rank: int, config: Dict) -> Dict:
    """RPC target on trainer ``rank`` (the tutorial's ``_run_trainer``): the training loop; returns its figures."""
    spec = CTRSpec()
    data = PlantedCTR(spec, seed=config["seed"])
    torch.manual_seed(config["seed"])  # the job's tower initialisation (DDP copies rank 0's anyway)
    tower = dense_tower(len(tables) * config["embedding_dim"] + spec.num_dense, config["hidden"])
    model = HybridModel(tables, tower)
    qhm = dict(momentum=config["momentum"], nu=config["nu"])
    sparse_optimizer = DistributedOptimizer(QHM, [r for table in tables for r in table.remote_parameters()],
                                            lr=config["sparse_lr"], **qhm)
    dense_optimizer = DistributedOptimizer(QHM, [RRef(p) for p in model.tower.parameters()],
                                           lr=config["dense_lr"], **qhm)
    if not (sparse_optimizer.is_functional_optim and dense_optimizer.is_functional_optim):
        raise RuntimeError("torch's DistributedOptimizer did not pick FunctionalQHM for QHM")
    loss_fn = nn.BCEWithLogitsLoss()
    steps, batch_size = config["steps"], config["batch_size"]
    losses: List[float] = []
    phases = {phase: 0.0 for phase in PHASES}
    warmup = config.get("warmup", 0)  # steps trained before the timed window (and the CPU's) starts
    started = time.monotonic()
    for step in range(steps):
        if step == warmup:
            if config.get("started_path"):  # tells a watcher of the processes' CPU that the window starts
                pathlib.Path(f"{config['started_path']}.{rank}").touch()
            started = time.monotonic()
            phases = {phase: 0.0 for phase in PHASES}
        t0 = time.perf_counter()
        batch = data.batch(rank, step, batch_size)
        t1 = time.perf_counter()
        with dist_autograd.context() as context_id:
            pooled = model.lookups(batch.ids)
            t2 = time.perf_counter()
            loss = loss_fn(model(pooled, batch.dense).squeeze(1), batch.labels)
            t3 = time.perf_counter()
            dist_autograd.backward(context_id, [loss])
            t4 = time.perf_counter()
            sparse_optimizer.step(context_id)
            t5 = time.perf_counter()
            dense_optimizer.step(context_id)
            t6 = time.perf_counter()
        losses.append(loss.item())
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            phases[phase] += seconds
    elapsed = time.monotonic() - started
    if config.get("ended_path"):  # and that it ended
        pathlib.Path(f"{config['ended_path']}.{rank}").touch()
    return {"samples_per_s": (steps - warmup) * batch_size / elapsed, "seconds": elapsed,
            "loss": statistics.mean(losses[-config["loss_window"]:]),
            "phase_ms": {phase: 1e3 * seconds / (steps - warmup) for phase, seconds in phases.items()}}


def master(config: Dict, results_path: str) -> None:
    """Create the tables on the parameter servers, run both trainers, write their figures."""
    spec = CTRSpec()
    tables = [RemoteModule(f"{ps_name(i % NUM_PS)}/cpu", CTREmbeddingBag,
                           args=(rows, config["embedding_dim"], "sum" if bag == 1 else "mean",
                                 config["sparse"], config["init_std"], config["seed"] + i))
              for i, (rows, bag) in enumerate(zip(spec.vocab_sizes, spec.bag_sizes))]
    futures = [rpc.rpc_async(trainer_name(rank), run_trainer, args=(tables, rank, config),
                             timeout=RPC_TIMEOUT.total_seconds()) for rank in range(TRAINERS)]
    results = [future.wait() for future in futures]
    with open(results_path, "w") as out:
        json.dump(results, out)


@contextlib.contextmanager
def hosted_stores(*ports: int) -> Iterator[None]:
    """The rendezvous stores of a run, served from this process on ``ports`` of 127.0.0.1 while it runs."""
    stores = [dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=RPC_TIMEOUT)
              for port in ports]
    try:
        yield
    finally:
        del stores


def role(name: str) -> str:
    """The kind of a process of the run: ``master``, ``ps`` or ``trainer`` (``ROLES``)."""
    return name.rstrip("0123456789")


def run_process(name: str, rank: int, rpc_port: int, ddp_port: int, config: Dict, results_path: str) -> None:
    """Process body: ``master``, ``psN`` or ``trainerN``; returns once every peer is done (rpc.shutdown).
    The rendezvous stores on ``rpc_port`` and ``ddp_port`` are the caller's (``hosted_stores``).
    It runs ``config["threads"][role(name)]`` intra-op threads and names itself ``name`` (its comm)."""
    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own use, at shutdown
    name_this_process(name)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(True)  # every rank a client of the caller's stores
    world_size = 1 + NUM_PS + TRAINERS
    torch.set_num_threads(config["threads"][role(name)])
    if name.startswith("trainer"):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ddp_port}", rank=int(name[len("trainer"):]),
                                world_size=TRAINERS, timeout=RPC_TIMEOUT)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}",
                                              rpc_timeout=RPC_TIMEOUT.total_seconds(),
                                              _transports=list(config["transports"]) or None)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if name == MASTER:
        master(config, results_path)
    rpc.shutdown()  # waits for every peer's outstanding work
    if name.startswith("trainer"):
        dist.destroy_process_group()


def process_names() -> List[str]:
    """Every process of the reference run, in rank order."""
    return [MASTER] + [ps_name(i) for i in range(NUM_PS)] + [trainer_name(r) for r in range(TRAINERS)]
