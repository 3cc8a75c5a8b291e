"""Synthetic click-through data with a planted ground-truth model, and AUC.

Owns the default job's data: categorical features whose ids follow a
skewed (Zipf) frequency, dense features, and labels drawn from a known
logistic model over both (a per-id effect for every categorical feature,
a pairwise interaction between the first two, a linear and a nonlinear
dense term).  A feature of more ids than ``CTRSpec.tabulated_up_to`` keeps
no per-id tensor (``HashedFeature``): its ranks follow the Zipf law's
continuous inverse CDF, its ids are a fixed permutation of its ranks and
its planted effects a hash of the id, so a billion-id vocabulary costs
nothing to hold.  Because the true click probability of every sample is
known, so is the best AUC any model can reach on held-out data (the
*oracle* AUC): a trained model is judged against it.

Batches are pure functions of ``(seed, stream, index)``: a worker's data
position is just the number of batches it has read (``PlantedStream``,
the iterable a Trainer reads, saves and restores it), and the held-out
set is the same for everyone.  Nothing is downloaded.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Tuple

import torch
from torch import Tensor

import paramserver
from paramserver.tables.id_hash import initial_rows, salted
from paramserver.train.evaluation import auc  # noqa: F401 - this module's AUC, kept where it was

HOLDOUT_STREAM = 1_000_003  # a stream number no worker reads
#: The most ids a hashed feature may have: its permutation's products stay within int64.
HASHED_IDS_LIMIT = 1 << 32


@dataclass(frozen=True)
class CTRSpec:
    """The shape of the data: vocabulary sizes, bag sizes, dense features, skew and signal strength."""

    vocab_sizes: Tuple[int, ...] = (100_000, 20_000, 10_000, 5_000, 1_000, 500, 100, 20)
    #: Ids per sample for each categorical feature (1: one-hot; more: a multi-hot bag, mean-pooled).
    bag_sizes: Tuple[int, ...] = (1, 1, 1, 3, 1, 1, 1, 1)
    num_dense: int = 13
    zipf_exponent: float = 1.4
    #: Standard deviation of each id's planted effect on the logit.
    id_effect: float = 0.5
    interaction_dim: int = 4
    interaction_scale: float = 0.5
    dense_scale: float = 0.3
    base_logit: float = -1.0
    #: Features of more ids than this are drawn without per-id tensors (``HashedFeature``).
    tabulated_up_to: int = 1 << 26

    def __post_init__(self):
        if len(self.vocab_sizes) != len(self.bag_sizes):
            raise ValueError(f"vocab_sizes ({len(self.vocab_sizes)}) and bag_sizes ({len(self.bag_sizes)}) "
                             "must have one entry per categorical feature")
        if min(self.vocab_sizes) < 2 or min(self.bag_sizes) < 1:
            raise ValueError("every feature needs at least 2 ids and bags of at least 1 id")
        if len(self.vocab_sizes) < 2:
            raise ValueError("the planted interaction needs at least 2 categorical features")
        if max(self.vocab_sizes) > HASHED_IDS_LIMIT:
            raise ValueError(f"vocab_sizes: at most {HASHED_IDS_LIMIT} ids per feature, got {max(self.vocab_sizes)}")


class HashedFeature:
    """A feature of ``size`` ids drawn without per-id tensors: a sample's Zipf rank (exponent ``exponent``) exact
    among the ``HEAD_RANKS`` most frequent (a table of their weights), beyond them from the law's continuous
    inverse CDF (the density ``x ** -exponent`` over ``[HEAD_RANKS + 0.5, size + 0.5)``, each rank the nearest
    integer), its id ``(rank * step + offset) % size`` (a permutation of the ranks: ``step`` is prime to
    ``size``), and an id's planted values ``initial_rows`` of the id under salts of ``seed``: a fixed function
    of the id, as a table of draws would be."""

    #: The most frequent ranks, drawn from a table of their weights (the continuous law is off there).
    HEAD_RANKS = 1 << 16

    def __init__(self, size: int, exponent: float, seed: int):
        self.size, self.exponent, self.seed = size, exponent, seed
        g = torch.Generator().manual_seed(seed)
        self.offset = int(torch.randint(0, size, (1,), generator=g))
        step = int(torch.randint(1 << 29, 1 << 30, (1,), generator=g))
        while math.gcd(step, size) != 1:
            step += 1
        self.step = step
        head = min(size, self.HEAD_RANKS)
        self._low, self._high = head + 0.5, size + 0.5
        weights = torch.arange(1, head + 1, dtype=torch.float64).pow(-exponent)
        total = float(weights.sum()) + self._tail_integral(self._high)
        self._head_cdf = torch.cumsum(weights, 0) / total

    def _tail_integral(self, x: float) -> float:
        """The integral of the density ``t ** -exponent`` from ``_low`` to ``x``."""
        s, low = self.exponent, self._low
        if abs(s - 1.0) < 1e-9:
            return math.log(x / low)
        return (x ** (1.0 - s) - low ** (1.0 - s)) / (1.0 - s)

    def ids(self, uniform: Tensor) -> Tensor:
        """The ids of samples whose uniform draws (float64 in [0, 1)) are ``uniform``."""
        head_mass = float(self._head_cdf[-1])
        ranks = torch.searchsorted(self._head_cdf, uniform)  # 0-based; ``head`` where the tail draws it
        tail = uniform >= head_mass
        if bool(tail.any()):
            low, high, s = self._low, self._high, self.exponent
            share = (uniform[tail] - head_mass) / (1.0 - head_mass)  # uniform over the tail
            if abs(s - 1.0) < 1e-9:
                x = low * torch.exp(share * math.log(high / low))
            else:
                a, b = low ** (1.0 - s), high ** (1.0 - s)
                x = (a + share * (b - a)).pow(1.0 / (1.0 - s))
            ranks[tail] = torch.floor(x + 0.5).to(torch.int64) - 1
        ranks.clamp_(0, self.size - 1)
        return (ranks * self.step + self.offset) % self.size

    def values(self, ids: Tensor, salt: int, width: int, std: float) -> Tensor:
        """``width`` N(0, std²) values for each of ``ids`` (any shape), fixed by ``(seed, salt, id)``."""
        rows = initial_rows(ids.reshape(-1), self.seed * 1_000_003 + salt, width, std, torch.float32)
        return rows.view(*ids.shape, width)


class _HashedEffects:
    """A hashed feature's effects, indexed as a tensor of per-id values is (``effects[ids]``)."""

    def __init__(self, feature: HashedFeature, salt: int, width: int, std: float):
        self.feature, self.salt, self.width, self.std = feature, salt, width, std

    def __getitem__(self, ids: Tensor) -> Tensor:
        values = self.feature.values(ids, self.salt, self.width, self.std)
        return values.squeeze(-1) if self.width == 1 else values


@dataclass
class Batch:
    ids: List[Tensor]     # one (batch, bag size) int64 tensor per categorical feature
    dense: Tensor         # (batch, num_dense) float32
    labels: Tensor        # (batch,) float32, 0 or 1
    true_logits: Tensor   # (batch,) the planted model's logit for each sample

    def __len__(self) -> int:
        return self.labels.numel()


@dataclass
class PlantedCTR:
    """The ground truth: drawn once from ``seed``; ``batch(stream, index, size)`` samples from it."""

    spec: CTRSpec = field(default_factory=CTRSpec)
    seed: int = 0

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        spec = self.spec
        tabulated = [v if v <= spec.tabulated_up_to else 0 for v in spec.vocab_sizes]
        self.effects = [torch.randn(v, generator=g) * spec.id_effect for v in tabulated]
        self.interaction = [torch.randn(v, spec.interaction_dim, generator=g) * math.sqrt(spec.interaction_scale)
                            for v in tabulated[:2]]
        self.dense_weights = torch.randn(spec.num_dense, generator=g) * spec.dense_scale
        # Frequent ids are scattered over the id space, not bunched at the start of the table.
        self._rank_to_id = [torch.randperm(v, generator=g) for v in tabulated]
        self._cdfs = []
        for v in tabulated:
            weights = torch.arange(1, v + 1, dtype=torch.float64).pow(-spec.zipf_exponent)
            self._cdfs.append(torch.cumsum(weights / weights.sum(), 0))
        self._hashed = {index: HashedFeature(v, spec.zipf_exponent, self.seed * 1_000_003 + index)
                        for index, v in enumerate(spec.vocab_sizes) if v > spec.tabulated_up_to}
        for index, feature in self._hashed.items():
            self.effects[index] = _HashedEffects(feature, 0, 1, spec.id_effect)
            if index < 2:
                self.interaction[index] = _HashedEffects(feature, 1, spec.interaction_dim,
                                                         math.sqrt(spec.interaction_scale))

    def batch(self, stream: int, index: int, size: int) -> Batch:
        """Batch ``index`` of ``stream`` (a worker's number; ``HOLDOUT_STREAM`` for held-out data)."""
        g = torch.Generator().manual_seed(hash((self.seed, stream, index)) % 2**62)
        ids = []
        for index, (cdf, rank_to_id, bag) in enumerate(zip(self._cdfs, self._rank_to_id, self.spec.bag_sizes)):
            uniform = torch.rand(size, bag, generator=g, dtype=torch.float64)
            if index in self._hashed:
                ids.append(self._hashed[index].ids(uniform))
                continue
            ranks = torch.searchsorted(cdf, uniform).clamp_(max=cdf.numel() - 1)
            ids.append(rank_to_id[ranks])
        dense = torch.randn(size, self.spec.num_dense, generator=g)
        logits = self.logits(ids, dense)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return Batch(ids=ids, dense=dense, labels=labels, true_logits=logits)

    def logits(self, ids: List[Tensor], dense: Tensor) -> Tensor:
        """The planted model's logit for each sample."""
        logit = torch.full((dense.size(0),), self.spec.base_logit)
        for effect, feature_ids in zip(self.effects, ids):
            logit += effect[feature_ids].mean(1)
        left, right = (table[feature_ids].mean(1) for table, feature_ids in zip(self.interaction, ids))
        logit += (left * right).sum(1)
        logit += dense @ self.dense_weights + 0.5 * torch.relu(dense[:, 0]) * dense[:, 1]
        return logit

    def holdout(self, size: int, batch_size: int = 4096) -> List[Batch]:
        """The held-out set: the same ``size`` samples for every worker, in batches."""
        return [self.batch(HOLDOUT_STREAM, index, min(batch_size, size - start))
                for index, start in enumerate(range(0, size, batch_size))]



def feature_names(spec: CTRSpec) -> List[str]:
    """The tables of the CTR model: one per categorical feature."""
    return [f"feature{i}" for i in range(len(spec.vocab_sizes))]


def to_batch(planted: Batch, hashed: bool = False) -> paramserver.Batch:
    """A planted batch as a Trainer reads it (ids by table name).  ``hashed``: every id as a raw 64-bit hash
    (a fixed function of the feature and the id, anywhere in int64, as real categorical values are), for
    dynamic tables."""
    ids = [salted(feature_ids, index) if hashed else feature_ids for index, feature_ids in enumerate(planted.ids)]
    return paramserver.Batch(sparse=dict(zip([f"feature{i}" for i in range(len(ids))], ids)),
                             dense=planted.dense, labels=planted.labels)


class PlantedStream:
    """Batches of ``size`` from ``stream`` of ``data``, endlessly (ids as raw hashes with ``hashed``); its
    position is the next batch's index (``state_dict``/``load_state_dict``, as torchdata's StatefulDataLoader)."""

    def __init__(self, data: PlantedCTR, stream: int, size: int, hashed: bool = False):
        self.data, self.stream, self.size, self.hashed = data, stream, size, hashed
        self.index = 0

    def __iter__(self) -> Iterator[paramserver.Batch]:
        while True:
            batch = self.data.batch(self.stream, self.index, self.size)
            self.index += 1
            yield to_batch(batch, self.hashed)

    def state_dict(self) -> Dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.index = int(state["index"])
