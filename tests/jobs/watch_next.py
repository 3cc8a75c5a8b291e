"""A second Trainer job, unlike the CTR one, for the fault tests: which video a user watches next.

Other tables (``user``; ``history``, a bag of recently watched videos
mean-pooled; ``video``, the candidate; ``creator``), another tower (a
factorization machine: pairwise dot products of the pooled embeddings
plus a linear term over every input) and another data generator
(a planted low-rank affinity between users and videos).  It has no fault
handling of its own: the guarantees are the Trainer's.

``stateful=False`` hands the Trainer a plain iterable (its position is
re-created by skipping batches); ``stateful=True`` one with
``state_dict()``/``load_state_dict()``.  ``crash_in_checkpoint_at=s``
makes worker 0 SIGKILL itself in the middle of the first checkpoint of
step ``s`` or later that it writes as rank 0 of its group: after the
shards wrote their parts, when the Trainer reads the dense part's state.
``dynamic_video=True`` makes the candidate video's table a dynamic one,
over the video ids as raw 64-bit hashes.  ``row_wise_min_rows``: the
Trainer's.  ``staleness``, ``cache_rows``, ``cache_steps``: the Trainer's.  ``eval_scores=PATH``: the scores
of the last held-out evaluation (the tower's outputs in eval mode) are saved there, as one
tensor, for comparing an export's (worker 0).  ``kill_at_first_build=PATH``:
worker 1 SIGKILLs the process whose pid that file holds (a shard's) right
before the Trainer first builds its tables on the shards, as if that
shard's process died as the job started.  ``fail_at_start_worker=i``: the
job of the worker of index ``i`` raises before it trains.  ``row_dtype``:
the tables' row type on the shards (``"float16"``; float32 by default);
``video_capacity``: the dynamic video table's rows per shard (it evicts
the least recently touched past it).  ``kill_shard=[PATH, n]``: worker 0
SIGKILLs the process whose pid that file holds (a shard's) as its n-th
training forward pass begins (between two steps' pushes).
"""

import os
import pathlib
import signal
from typing import Dict, Iterator, List, Optional

import torch
from torch import Tensor, nn

from paramserver import Batch, Table, Trainer
from paramserver.optim import QHM
from paramserver.tables.id_hash import salted
from paramserver.train import sparse
from paramserver.train.trainer import ROW_WISE_MIN_ROWS

USERS, VIDEOS, CREATORS, RANK, HISTORY, DENSE = 600, 400, 50, 4, 4, 3


class Planted:
    """The ground truth: user and video factors, each video's creator, a dense-feature effect."""

    def __init__(self, seed: int, hashed_videos: bool = False):
        self.hashed_videos = hashed_videos  # the candidate video's id as a raw 64-bit hash (a dynamic table)
        g = torch.Generator().manual_seed(seed)
        self.users = torch.randn(USERS, RANK, generator=g)
        self.videos = torch.randn(VIDEOS, RANK, generator=g)
        self.creator_of = torch.randint(0, CREATORS, (VIDEOS,), generator=g)
        self.dense_weights = torch.randn(DENSE, generator=g) * 0.5
        self.user_bias = torch.randn(USERS, generator=g)
        self.video_bias = torch.randn(VIDEOS, generator=g)

    def batch(self, stream: int, index: int, size: int) -> Batch:
        g = torch.Generator().manual_seed(stream * 1_000_003 + index)
        users = torch.randint(0, USERS, (size, 1), generator=g)
        history = torch.randint(0, VIDEOS, (size, HISTORY), generator=g)
        video = torch.randint(0, VIDEOS, (size, 1), generator=g)
        dense = torch.randn(size, DENSE, generator=g)
        taste = self.users[users[:, 0]] + 0.5 * self.videos[history].mean(1)
        logits = (0.5 * (taste * self.videos[video[:, 0]]).sum(1) + self.user_bias[users[:, 0]]
                  + self.video_bias[video[:, 0]] + dense @ self.dense_weights - 0.5)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return Batch(sparse={"user": users, "history": history,
                             "video": salted(video, 1) if self.hashed_videos else video,
                             "creator": self.creator_of[video]}, dense=dense, labels=labels)


class Sessions:
    """Worker ``stream``'s batches, endlessly; a plain iterable (no saved position)."""

    def __init__(self, planted: Planted, stream: int, size: int):
        self.planted, self.stream, self.size = planted, stream, size
        self.index = 0

    def __iter__(self) -> Iterator[Batch]:
        while True:
            self.index += 1
            yield self.planted.batch(self.stream, self.index - 1, self.size)


class StatefulSessions(Sessions):
    """``Sessions`` with a position (torchdata's StatefulDataLoader convention)."""

    def state_dict(self) -> Dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.index = int(state["index"])


class FactorizationMachine(nn.Module):
    """Pairwise dot products of the tables' pooled embeddings, and a linear term over every input."""

    def __init__(self, tables: List[str], dim: int, dense_features: int):
        super().__init__()
        self.tables, self.dim, self.dense_features = tables, dim, dense_features
        pairs = len(tables) * (len(tables) - 1) // 2
        self.pair_weights = nn.Parameter(torch.ones(pairs))
        self.linear = nn.Linear(len(tables) * dim + dense_features, 1)

    def export_kwargs(self) -> Dict:
        return {"tables": self.tables, "dim": self.dim, "dense_features": self.dense_features}

    def forward(self, pooled: Dict[str, Tensor], dense: Tensor) -> Tensor:
        vectors = [pooled[name] for name in self.tables]
        dots = torch.stack([(vectors[i] * vectors[j]).sum(1)
                            for i in range(len(vectors)) for j in range(i + 1, len(vectors))], 1)
        return dots @ self.pair_weights + self.linear(torch.cat(vectors + [dense], 1)).squeeze(1)


def crash_mid_checkpoint(module: nn.Module, checkpoints: pathlib.Path, from_step: int) -> None:
    """SIGKILL this process when ``module``'s state is read while a checkpoint of step ``from_step`` or later
    has its shards' parts written but no manifest yet (the Trainer writing it, on rank 0)."""
    def before_state_dict(*_args):
        for directory in checkpoints.glob("ckpt-*"):
            if int(directory.name[5:]) >= from_step and not (directory / "MANIFEST.json").exists() \
                    and list(directory.glob("shard-*")):
                os.kill(os.getpid(), signal.SIGKILL)
    module.register_state_dict_pre_hook(before_state_dict)


def kill_before_first_build(pid_file: pathlib.Path) -> None:
    """SIGKILL the process whose pid ``pid_file`` holds right before this process first builds a Trainer's tables
    on the shards (the requests that create them then meet a shard process that died)."""
    build = sparse.build_tables

    def killing_first(*args, **kwargs):
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
            pid_file.unlink()
        return build(*args, **kwargs)
    sparse.build_tables = killing_first


def kill_at_forward(module: nn.Module, pid_file: pathlib.Path, forward: int) -> None:
    """SIGKILL the process whose pid ``pid_file`` holds as ``module``'s ``forward``-th training forward pass
    begins (its step's rows were read; the step before's push was applied)."""
    passes = [0]

    def before_forward(*_args):
        if module.training:
            passes[0] += 1
            if passes[0] == forward and pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                pid_file.unlink()
    module.register_forward_pre_hook(before_forward)


def evaluated_scores(module: nn.Module) -> List[Tensor]:
    """Every output of ``module`` in eval mode (the Trainer's evaluations), in order."""
    scores: List[Tensor] = []
    module.register_forward_hook(lambda _, inputs, output: None if module.training else
                                 scores.append(output.detach().clone()))
    return scores


def main(ctx, steps: int = 200, batch_size: int = 128, dim: int = 8, lr: float = 16.0, stateful: bool = False,
         crash_in_checkpoint_at: Optional[int] = None, log_every: int = 10, eval_every: int = 50,
         seed: int = 7, dynamic_video: bool = False, row_wise_min_rows: int = ROW_WISE_MIN_ROWS,
         eval_scores: Optional[str] = None, staleness: int = 0, cache_rows: Optional[int] = None,
         cache_steps: Optional[int] = None, kill_at_first_build: Optional[str] = None,
         fail_at_start_worker: Optional[int] = None, row_dtype: str = "float32",
         video_capacity: Optional[int] = None, kill_shard: Optional[List] = None) -> dict:
    if ctx.worker_index == fail_at_start_worker:
        raise RuntimeError(f"worker {fail_at_start_worker}'s job fails at start (fail_at_start_worker)")
    planted = Planted(seed, hashed_videos=dynamic_video)
    data = (StatefulSessions if stateful else Sessions)(planted, ctx.worker_index, batch_size)
    rows = dict(init_std=0.1, dtype=getattr(torch, row_dtype))
    tables = {"user": Table(USERS, dim, **rows), "history": Table(VIDEOS, dim, mode="mean", **rows),
              "video": Table(None, dim, capacity=video_capacity, **rows) if dynamic_video else Table(VIDEOS, dim, **rows),
              "creator": Table(CREATORS, dim, **rows)}
    torch.manual_seed(seed)
    tower = FactorizationMachine(list(tables), dim, DENSE)
    if crash_in_checkpoint_at is not None and ctx.worker_index == 0:
        crash_mid_checkpoint(tower, pathlib.Path(ctx.checkpoint.directory), crash_in_checkpoint_at)
    if kill_at_first_build is not None and ctx.worker_index == 1:
        kill_before_first_build(pathlib.Path(kill_at_first_build))
    if kill_shard is not None and ctx.worker_index == 0:
        kill_at_forward(tower, pathlib.Path(kill_shard[0]), int(kill_shard[1]))
    scores = evaluated_scores(tower) if eval_scores else []
    trainer = Trainer(ctx, tables=tables, dense=tower,
                      sparse_optimizer=(QHM, dict(lr=lr, momentum=0.9, nu=0.7)),
                      dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
                      loss=nn.BCEWithLogitsLoss(), comm_hook="allreduce", name="watch", seed=seed,
                      row_wise_min_rows=row_wise_min_rows, staleness=staleness, cache_rows=cache_rows,
                      cache_steps=cache_steps)
    holdout = [planted.batch(999, index, 1024) for index in range(2)]
    figures = trainer.fit(data, steps=steps, eval_data=holdout, eval_every=eval_every, log_every=log_every)
    if scores:
        torch.save(torch.cat(scores[-len(holdout):]), eval_scores)
    return figures
