"""A lookup's distinct ids, found once: by the batch reader ahead of the step, then taken by the tables' routes."""

import pytest
import torch

from paramserver import Batch, Table
from paramserver.tables import DistinctIds, distinct_ids
from paramserver.train.data import BatchStream


def _batch(**sparse) -> Batch:
    size = next(iter(sparse.values())).size(0)
    return Batch(sparse=sparse, dense=torch.zeros(size, 2), labels=torch.zeros(size))


def test_distinct_ids_are_the_sorted_values_and_where_each_id_is_among_them():
    ids = torch.tensor([[7, -3], [7, 2**40], [-3, -3]], dtype=torch.int64)
    found = distinct_ids(ids)
    assert found.ids.tolist() == [-3, 7, 2**40]
    assert torch.equal(found.ids[found.inverse].view(ids.shape), ids)
    narrow = distinct_ids(ids.clamp(-100, 100).int())  # int32 ids are found as int64, as a route takes them
    assert narrow.ids.dtype == torch.int64 and narrow.ids.tolist() == [-3, 7, 100]


def test_distinct_ids_found_ahead_are_taken_as_they_are_once_they_fit_and_refused_naming_the_table_if_not():
    ids = torch.randint(0, 50, (8, 3))
    ahead = distinct_ids(ids)
    assert distinct_ids(ids, ahead, "users") is ahead
    with pytest.raises(ValueError, match=r"table 'users': distinct ids found for 24 ids are handed with 6 ids"):
        distinct_ids(ids[:2], ahead, "users")


def test_a_batch_finds_its_tables_distinct_ids_and_leaves_ids_of_a_wrong_type_to_its_check():
    batch = _batch(users=torch.tensor([[1, 2], [2, 2]]), items=torch.tensor([[0.5], [1.5]]))
    batch.find_distinct_ids()
    assert set(batch.distinct) == {"users"} and batch.distinct["users"].ids.tolist() == [1, 2]
    assert isinstance(batch.distinct["users"], DistinctIds)
    with pytest.raises(ValueError, match="table 'items': ids must be a"):
        batch.check({"users": Table(10, 4), "items": Table(10, 4)})


def test_batches_read_ahead_for_the_trainer_come_with_their_distinct_ids_found_and_others_without():
    batches = [_batch(users=torch.randint(0, 20, (4, 2))) for _ in range(5)]
    stream = BatchStream(batches, position={"used": 2}, prefetch=2)  # a restore skips 2 batches
    try:
        assert stream.ensure(3)
        for offset, batch in enumerate(batches[2:]):
            taken = stream.ahead(offset)
            assert taken is batch  # in the reader's thread
            assert torch.equal(taken.distinct["users"].ids, batch.sparse["users"].unique())
        assert all(not skipped.distinct for skipped in batches[:2])  # no work for batches only skipped
    finally:
        stream.close()
    unread = [_batch(users=torch.randint(0, 20, (4, 2)))]
    stream = BatchStream(unread)  # nothing read ahead: the step's route finds them
    assert stream.ahead(0) is unread[0] and not unread[0].distinct
