"""A small job: sparse linear regression whose table lives on the shards.

Each worker learns, on its own data stream, a planted model
``y = sum of weight[id] over a bag of ids + noise``: the table is a
``ShardedEmbeddingBag`` on the cluster's shards, updated there by
``DistributedOptimizer(QHM)``.  It exercises the whole path (join, data
plane, server-side optimizer, progress in heartbeats) in seconds; the
loss falls towards the noise floor (``noise ** 2``).  Returns the first
and final loss, the noise floor and the steps taken.  With its own loop,
it hands the table and the optimizer the worker's data-plane recorder
itself (``ctx.recorders``: set when the worker serves metrics).
"""

import time

import torch
import torch.distributed.autograd as dist_autograd

from paramserver.optim import QHM, DistributedOptimizer
from paramserver.shards import ShardedEmbeddingBag


def main(ctx, steps: int = 200, num_ids: int = 1000, bag_size: int = 8, batch_size: int = 64,
         lr: float = 4.0, noise: float = 0.1, seed: int = 0, report_every: int = 10) -> dict:
    truth = torch.Generator().manual_seed(seed + 10_000)
    planted = torch.randn(num_ids, 1, generator=truth)
    data = torch.Generator().manual_seed(seed + 1 + ctx.worker_index)
    recorder = ctx.recorders.data_plane
    table = ShardedEmbeddingBag(num_ids, 1, "sum", shards=ctx.shards, recorder=recorder)
    optimizer = DistributedOptimizer(QHM, table.remote_parameters(), lr=lr, momentum=0.9, nu=0.7, recorder=recorder)
    started = time.monotonic()
    first_loss = loss_value = float("nan")
    step = 0
    for step in range(1, steps + 1):
        if ctx.should_stop():
            break
        ids = torch.randint(0, num_ids, (batch_size, bag_size), generator=data)
        target = planted[ids].sum(1) + noise * torch.randn(batch_size, 1, generator=data)
        with dist_autograd.context() as context_id:
            loss = (table(ids) - target).pow(2).mean()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        loss_value = loss.item()
        if step == 1:
            first_loss = loss_value
        if step % report_every == 0 or step == steps:
            ctx.report(step, loss=loss_value, samples_per_s=step * batch_size / (time.monotonic() - started))
    return {"first_loss": first_loss, "loss": loss_value, "noise_floor": noise ** 2, "steps": step}
