"""``PublishedPositions`` (one process, a real c10d store): the data positions that trainer groups other than 0
publish at their agreements for group 0's checkpoints; with staleness k, only a position all of whose pushes
have been applied (an agreement k steps back or more); a previous run's entries are not used, and a worker
without a usable one keeps the position of the checkpoint the run started from."""

import pytest
import torch.distributed as dist

from paramserver.train.positions import PublishedPositions


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield dist.PrefixStore("job/data_positions", master)
    del master


def position(used: int) -> dict:
    return {"used": used, "state": {"index": used}}


def test_a_member_publishes_its_position_at_each_agreement_and_group_0_reads_the_others(store):
    members = {index: PublishedPositions(store) for index in (1, 2)}
    for step in (0, 10, 20):
        for index, published in members.items():
            published.publish(index, f"worker{index}", step, position(step + index))
    reader = PublishedPositions(store)
    assert reader.read(skip=[0]) == {1: position(21), 2: position(22)}
    assert reader.read(skip=[0, 2]) == {1: position(21)}  # group 0's own members: not read here


def test_with_staleness_the_position_published_is_one_whose_pushes_were_applied(store):
    published = PublishedPositions(store, staleness=2)
    reader = PublishedPositions(store)
    published.publish(1, "worker1", 0, position(0))  # step 0 - 2 < 0: nothing yet
    assert reader.read(skip=[]) == {}
    for step in (1, 3, 4):  # agreements sooner than every 10 steps (a followed input short of data)
        published.publish(1, "worker1", step, position(step))
    # At step 4 the pushes of steps 2 and 3 may be in flight: the newest agreement at step 2 or before is 1's.
    assert reader.read(skip=[]) == {1: position(1)}
    published.publish(1, "worker1", 14, position(14))
    assert reader.read(skip=[]) == {1: position(4)}


def test_a_previous_runs_entry_is_not_used_and_the_restored_position_is_kept_instead(store):
    PublishedPositions(store, run=1).publish(1, "worker1", 50, position(50))  # run 1: its workers are gone since
    reader = PublishedPositions(store, run=2)
    restored = {0: position(30), 1: position(30)}  # the checkpoint run 2 started from
    assert reader.read(skip=[0], kept=restored) == {1: position(30)}
    assert reader.read(skip=[0]) == {}
    PublishedPositions(store, run=2).publish(1, "worker1", 40, position(40))  # run 2's worker1, at its agreement
    assert reader.read(skip=[0], kept=restored) == {1: position(40)}


def test_with_one_group_nothing_is_read_not_even_the_restored_positions(store):
    """(One trainer group, a followed input too: its restore merges every saved position itself.)"""
    assert PublishedPositions(store).read(skip=[0, 1], kept={2: position(5)}) == {}
