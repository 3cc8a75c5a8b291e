"""Driver programs that tests run in a spawned child against a running cluster
(torch RPC is per process, so a driver never runs inside pytest itself)."""

import torch
import torch.distributed.autograd as dist_autograd

import paramserver
from paramserver.optim import QHM, DistributedOptimizer


def train_an_embedding_through_connect(address: str, token: str) -> None:
    """connect(), place a sharded table and a dense module, take optimizer steps, close."""
    with paramserver.connect(address, token=token) as cluster:
        assert cluster.shards == ["shard0", "shard1"], cluster.shards
        assert any(c.name == cluster.name and c.alive for c in cluster.status().clients)
        table = cluster.embedding_bag(50, 4, "sum")
        head = cluster.place(torch.nn.Linear(4, 1))
        assert set(head.placement().values()) <= {"shard0", "shard1"}
        before = table.fetch_weight()
        optimizer = DistributedOptimizer(QHM, table.remote_parameters() + head.remote_parameters(),
                                         lr=0.1, momentum=0.9, nu=0.7)
        ids = torch.tensor([[1, 2, 3], [4, 5, 49]])
        losses = []
        for _ in range(5):
            with dist_autograd.context() as context_id:
                loss = (head(table(ids)) - torch.ones(2, 1)).pow(2).mean()
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            losses.append(loss.item())
        after = table.fetch_weight()
        touched = sorted({1, 2, 3, 4, 5, 49})
        assert not torch.equal(after[touched], before[touched])
        untouched = [row for row in range(50) if row not in touched]
        assert torch.equal(after[untouched], before[untouched])
        assert losses[-1] < losses[0], losses
