"""A small Trainer job on ``JobContext.local()`` (the process is the shard of its tables: every push crosses
the shard service), run as its own process so that a test can start it with TorchScript on or off
(``PYTORCH_JIT=0`` is read when torch is imported).  ``python shard_job.py OUT OPTIMIZER`` writes to OUT the
step losses and every table's rows as the shard holds them (a dynamic table's by id)."""

import sys

import torch

from paramserver import Batch, JobContext, Table, Trainer
from paramserver.optim import FTRL, QHM, RowWiseAdagrad
from paramserver.shards.server import service
from test_pipeline import Tower  # (this script's folder is on its path)

OPTIMIZERS = {"rowwise_adagrad": (RowWiseAdagrad, dict(lr=0.2)), "ftrl": (FTRL, dict(lr=0.2, l1=0.001)),
              "adam": (torch.optim.Adam, dict(lr=0.01)), "qhm": (QHM, dict(lr=0.5, momentum=0.9, nu=0.7))}
STEPS = 20


def batches():
    generator = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        yield Batch(sparse={"fixed": torch.randint(0, 30, (16, 3), generator=generator),
                            "hashed": torch.randint(0, 60, (16, 1), generator=generator) * 0x9E3779B97F4A7C15 % 2 ** 62},
                    dense=torch.randn(16, 2, generator=generator),
                    labels=(torch.rand(16, generator=generator) < 0.5).float())


def main(out: str, optimizer: str) -> None:
    losses = []
    bce = torch.nn.BCEWithLogitsLoss()

    def loss(logits, labels):
        value = bce(logits, labels)
        losses.append(value.detach().clone())
        return value

    torch.manual_seed(0)
    with JobContext.local() as ctx:
        trainer = Trainer(ctx, tables={"fixed": Table(30, 4), "hashed": Table(None, 4)}, dense=Tower(),
                          sparse_optimizer=OPTIMIZERS[optimizer],
                          dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=loss, name="job")
        figures = trainer.fit(batches(), steps=STEPS)
        assert figures["sparse_steps"] == STEPS, figures
        state = service._state()
        rows = {}
        for name, table in state.shared_tables().items():
            dynamic = state.dynamic_rows(table)
            if dynamic is None:
                rows[name] = table.detach().clone()
            else:
                ids, slots = dynamic.index.items()
                order = ids.argsort()
                rows[name] = (ids[order], table.detach()[slots[order]].clone())
        torch.save({"losses": torch.stack(losses), "rows": rows, "scripted": torch.jit._state._enabled.enabled}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
