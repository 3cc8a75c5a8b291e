"""Held-out figures of a click model: AUC and log loss, and scoring a held-out set.

Owns the metrics the Trainer reports on ``eval_data`` (rank 0 of a group
evaluates); pure functions of scores and labels, plus ``evaluate`` which
scores batches with a given scoring function.
"""

from typing import Callable, Dict, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from .contract import Batch


def auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic; tied scores share their mean rank)."""
    scores, labels = scores.detach().reshape(-1).double(), labels.detach().reshape(-1).double()
    positives = labels.sum().item()
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        raise ValueError(f"AUC needs both classes, got {positives:.0f} positives and {negatives:.0f} negatives")
    order = torch.argsort(scores)
    _, inverse, counts = torch.unique(scores[order], return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_ranks = (ends - (counts.double() - 1) / 2)[inverse]  # 1-based mean rank of each tie block
    rank_sum = (mean_ranks * labels[order]).sum().item()
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def log_loss(logits: Tensor, labels: Tensor) -> float:
    """Mean binary cross-entropy of the logits against 0/1 labels."""
    return F.binary_cross_entropy_with_logits(logits.detach().reshape(-1).double(),
                                              labels.detach().reshape(-1).double()).item()


@torch.no_grad()
def evaluate(score: Callable[[Batch], Tensor], batches: Iterable[Batch]) -> Dict[str, float]:
    """``auc`` and ``log_loss`` of ``score(batch)`` (logits) over every batch."""
    logits, labels = [], []
    for batch in batches:
        logits.append(score(batch).reshape(-1).cpu())
        labels.append(batch.labels.reshape(-1))
    logits_all, labels_all = torch.cat(logits), torch.cat(labels)
    return {"auc": auc(logits_all, labels_all), "log_loss": log_loss(logits_all, labels_all)}
