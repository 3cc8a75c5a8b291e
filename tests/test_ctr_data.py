"""The default job's data: the planted CTR generator (deterministic batches,
skewed ids, labels that follow the planted logit) and the AUC it is judged by."""

import itertools
import math

import pytest
import torch

from paramserver.jobs.ctr_data import HASHED_IDS_LIMIT, CTRSpec, HashedFeature, PlantedCTR, auc


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
    with pytest.raises(ValueError, match=f"at most {HASHED_IDS_LIMIT} ids per feature"):
        CTRSpec(vocab_sizes=(HASHED_IDS_LIMIT + 1, 10), bag_sizes=(1, 1))


def test_a_hashed_feature_follows_the_same_law_as_a_tabulated_one():
    """Past ``tabulated_up_to`` a feature keeps no per-id tensor: its ids follow the same Zipf law (the counts of
    the most frequent ids and the number of distinct ids agree with the tabulated draw of the same uniforms), stay
    in range, and its planted effects are a fixed function of the id that the labels follow."""
    spec = dict(vocab_sizes=(300_000, 70_000, 50), bag_sizes=(1, 2, 1), zipf_exponent=1.05)
    tabulated = PlantedCTR(CTRSpec(**spec), seed=2).batch(0, 0, 60_000)
    hashed_data = PlantedCTR(CTRSpec(**spec, tabulated_up_to=60_000), seed=2)
    hashed = hashed_data.batch(0, 0, 60_000)
    assert not isinstance(hashed_data.effects[0], torch.Tensor) and isinstance(hashed_data.effects[2], torch.Tensor)
    for feature, vocab in ((0, 300_000), (1, 70_000)):
        ours, theirs = hashed.ids[feature].reshape(-1), tabulated.ids[feature].reshape(-1)
        assert 0 <= ours.min() and ours.max() < vocab
        top = ours.unique(return_counts=True)[1].sort(descending=True).values.double()
        expected = theirs.unique(return_counts=True)[1].sort(descending=True).values.double()
        assert top[:50].tolist() == pytest.approx(expected[:50].tolist(), rel=0.02)
        assert top.numel() == pytest.approx(expected.numel(), rel=0.02)
    again = PlantedCTR(CTRSpec(**spec, tabulated_up_to=60_000), seed=2).batch(0, 0, 60_000)
    assert torch.equal(again.true_logits, hashed.true_logits)
    probability = torch.sigmoid(hashed.true_logits)
    assert hashed.labels.mean().item() == pytest.approx(probability.mean().item(), abs=0.01)
    assert 0.7 < auc(hashed.true_logits, hashed.labels) < 0.95


def test_a_billion_id_feature_costs_no_per_id_memory():
    data = PlantedCTR(CTRSpec(vocab_sizes=(1_000_000_000, 20), bag_sizes=(1, 1), zipf_exponent=1.05), seed=0)
    ids = data.batch(0, 0, 20_000).ids[0]
    assert 0 <= ids.min() and ids.max() < 1_000_000_000
    assert ids.unique().numel() > 5_000  # a long tail
    for size in (1_000_000_000, 1 << 30, 2 * 3 * 5 * 7 * 11 * 13, 65_537):
        feature = HashedFeature(size, 1.05, seed=1)
        assert math.gcd(feature.step, size) == 1  # rank -> id is a permutation
        ranks = torch.arange(min(size, 100_000))
        assert ((ranks * feature.step + feature.offset) % size).unique().numel() == ranks.numel()
