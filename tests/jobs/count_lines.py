"""A Trainer job that says which lines each step trained, for the test of shares dealt by the membership
(``tests/test_data_shares_cluster.py``).

It follows ``train`` (Criteo-format files whose first integer feature ``I1`` is the line's number plus one:
``numbered``), with the group dealing the files (no ``workers`` set anywhere), and its tower records, at
every forward pass of a step, ``<step> <line>,<line>,...`` in ``<records>/<worker name>.txt`` (one write
per record).  The step is read from the dense optimizer, which counts the steps it applied and, as the
group shares state, takes the count of the member it takes state from.  When it ends it writes its figures
to ``<records>/<worker name>.json``.
"""

import datetime
import json
import math
import os
import pathlib

import torch
from torch import nn

from paramserver import Batch, Table, Trainer
from paramserver.data import FileReader
from paramserver.optim import QHM


def numbered(index: int) -> str:
    """A Criteo line whose ``I1`` is ``index + 1`` (and ``C1`` spells ``index``)."""
    hashes = ["%08x" % index] + ["%08x" % ((index * 2654435761 + j) & 0xFFFFFFFF) for j in range(1, 26)]
    return "\t".join([str(index % 2), str(index + 1), *[""] * 12, *hashes])


class FirstColumn(FileReader):
    """The reader with only the ``C1`` table's ids in its batches (one table: a quicker job)."""

    def __iter__(self):
        for batch in super().__iter__():
            yield Batch(sparse={"C1": batch.sparse["C1"]}, dense=batch.dense, labels=batch.labels)


class CountingSGD(torch.optim.SGD):
    """SGD that counts the steps it applied (in its parameter group: carried by ``state_dict``)."""

    def __init__(self, params, **options):
        super().__init__(params, **options)
        for group in self.param_groups:
            group.setdefault("taken", 0)

    def step(self, closure=None):
        loss = super().step(closure)
        self.param_groups[0]["taken"] += 1
        return loss


class RecordingTower(nn.Module):
    """A linear tower that records the lines of every batch it is run on, with the step (``step()``)."""

    def __init__(self, tables, dim: int, dense: int, record_to: pathlib.Path, step):
        super().__init__()
        self.linear = nn.Linear(len(tables) * dim + dense, 1)
        self.tables, self.record_to, self.step = list(tables), record_to, step

    def forward(self, pooled, dense):
        if self.training:
            lines = (torch.expm1(dense[:, 0].double()).round().long() - 1).tolist()
            record = f"{self.step()} {','.join(map(str, lines))}\n".encode()
            descriptor = os.open(self.record_to, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(descriptor, record)
            finally:
                os.close(descriptor)
        return self.linear(torch.cat([pooled[name] for name in self.tables] + [dense], 1)).squeeze(1)


def main(ctx, train: str, records: str, steps: int = 10 ** 6, batch_size: int = 4, poll_seconds: float = 0.1,
         agree_every: int = 5) -> dict:
    reader = FirstColumn(train, batch_size, follow=True, poll=datetime.timedelta(seconds=poll_seconds),
                         chunk_bytes=2_000, threads=1)
    tables = {"C1": Table(None, 2, init_std=0.1)}
    optimizers = []

    def dense_optimizer(params):
        optimizers.append(CountingSGD(params, lr=0.05))
        return optimizers[-1]

    folder = pathlib.Path(records)
    tower = RecordingTower(tables, 2, reader.num_dense, folder / f"{ctx.rpc_name}.txt",
                           lambda: optimizers[-1].param_groups[0]["taken"])
    trainer = Trainer(ctx, tables=tables, dense=tower, sparse_optimizer=(QHM, dict(lr=0.1, momentum=0.9, nu=0.7)),
                      dense_optimizer=dense_optimizer, loss=nn.BCEWithLogitsLoss(), name="count",
                      agree_every=agree_every)
    try:
        figures = trainer.fit(reader, steps=steps, log_every=10 ** 9)
    finally:
        reader.close()
    (folder / f"{ctx.rpc_name}.json").write_text(json.dumps({key: value for key, value in figures.items()
                                                             if isinstance(value, (int, float))
                                                             and not math.isnan(value)}))
    return figures
