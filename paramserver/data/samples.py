"""Parsed samples before they are cut into batches: ``Samples`` (labels, dense features, ids per table).

Owns the in-memory form every input format parses into, and the two
operations the reader needs on it: taking a range of samples and joining
samples from consecutive chunks into one batch (``paramserver.Batch``).
"""

from dataclasses import dataclass
from typing import Dict, List

import torch
from torch import Tensor

from ..train.contract import Batch


@dataclass
class Samples:
    """``labels`` (n,) float32, ``dense`` (n, features) float32, ``ids[table]`` (n, bag) int64."""

    labels: Tensor
    dense: Tensor
    ids: Dict[str, Tensor]

    def __len__(self) -> int:
        return self.labels.numel()

    def slice(self, start: int, stop: int) -> "Samples":
        return Samples(self.labels[start:stop], self.dense[start:stop],
                       {name: ids[start:stop] for name, ids in self.ids.items()})

    @staticmethod
    def join(parts: List["Samples"]) -> "Samples":
        if len(parts) == 1:
            return parts[0]
        return Samples(torch.cat([p.labels for p in parts]), torch.cat([p.dense for p in parts]),
                       {name: torch.cat([p.ids[name] for p in parts]) for name in parts[0].ids})

    def batch(self) -> Batch:
        return Batch(sparse=dict(self.ids), dense=self.dense, labels=self.labels)
