"""The default job's data: the planted CTR generator (deterministic batches,
skewed ids, labels that follow the planted logit) and the AUC it is judged by."""

import itertools

import pytest
import torch

from paramserver.jobs.ctr_data import CTRSpec, PlantedCTR, auc


def brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_matches_the_pairwise_definition_with_ties():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 6, (200,), generator=g).float()  # many ties
    labels = torch.bernoulli(torch.full((200,), 0.4), generator=g)
    assert auc(scores, labels) == pytest.approx(brute_force_auc(scores.tolist(), labels.tolist()), abs=1e-12)
    assert auc(torch.tensor([0.1, 0.2, 0.9]), torch.tensor([0.0, 0.0, 1.0])) == 1.0
    assert auc(torch.tensor([0.9, 0.2, 0.1]), torch.tensor([0.0, 0.0, 1.0])) == 0.0


def test_auc_needs_both_classes():
    with pytest.raises(ValueError, match="both classes"):
        auc(torch.rand(5), torch.ones(5))


def test_batches_are_pure_functions_of_stream_and_index():
    data = PlantedCTR(seed=3)
    first, again, other = data.batch(0, 7, 64), PlantedCTR(seed=3).batch(0, 7, 64), data.batch(1, 7, 64)
    assert all(torch.equal(a, b) for a, b in zip(first.ids, again.ids))
    assert torch.equal(first.labels, again.labels)
    assert not torch.equal(first.dense, other.dense)
    assert [tuple(ids.shape) for ids in first.ids] == [(64, bag) for bag in data.spec.bag_sizes]


def test_ids_are_skewed_in_range_and_labels_follow_the_planted_logit():
    spec = CTRSpec()
    data = PlantedCTR(spec, seed=0)
    batch = data.batch(0, 0, 50_000)
    for ids, vocab in zip(batch.ids, spec.vocab_sizes):
        assert 0 <= ids.min() and ids.max() < vocab
    counts = torch.bincount(batch.ids[0].reshape(-1), minlength=spec.vocab_sizes[0]).sort(descending=True).values
    assert counts[:100].sum() > 0.5 * counts.sum()  # Zipf: the top 0.1% of ids carry most samples
    # Labels are Bernoulli(sigmoid(logit)): calibrated in bins of the planted probability.
    probability = torch.sigmoid(batch.true_logits)
    for low in (0.1, 0.3, 0.5, 0.7):
        in_bin = (probability >= low) & (probability < low + 0.2)
        assert batch.labels[in_bin].mean().item() == pytest.approx(probability[in_bin].mean().item(), abs=0.02)
    oracle = auc(batch.true_logits, batch.labels)
    assert 0.7 < oracle < 0.95
    assert auc(batch.dense[:, 0], batch.labels) < oracle  # a single feature does worse than the truth


def test_holdout_is_shared_and_sized():
    holdout = PlantedCTR(seed=0).holdout(10_000, batch_size=4096)
    assert [len(b) for b in holdout] == [4096, 4096, 1808]
    assert torch.equal(holdout[0].labels, PlantedCTR(seed=0).holdout(4096)[0].labels)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="one entry per categorical feature"):
        CTRSpec(vocab_sizes=(10, 10), bag_sizes=(1,))
    with pytest.raises(ValueError, match="at least 2 ids"):
        CTRSpec(vocab_sizes=(1, 10), bag_sizes=(1, 1))
