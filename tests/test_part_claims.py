"""A followed input read by several trainer groups (``paramserver.train.claims``): each part goes to the group
that claims it first, per run of the job; readers of different groups, each dealt alone, read every line once
between them, as they read it and after a restore (one process, a real TCPStore; a group's side in a trainer
group of one)."""

import datetime
import time

import pytest
import torch.distributed as dist

from paramserver.data import FileReader
from paramserver.data.shares import deal, under_way
from paramserver.train.claims import PartClaims

from test_data_follow import POLL, land
from test_data_shares import (group_of_one, lost_member_replayed, position, read_all,  # noqa: F401
                              two_readers_part_way)


@pytest.fixture
def store():
    """The coordinator's store, as a trainer group's job keys see it."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield dist.PrefixStore("job/followed_parts/run1", master)


def test_the_first_group_to_ask_for_a_part_has_it_and_every_later_asker_learns_whose_it_is(store):
    zero, one = PartClaims(store, 0), PartClaims(store, 1)
    assert zero.take("part-0.txt") is True and one.take("part-0.txt") is None and zero.take("part-0.txt") is True
    assert one.take("part-1.txt@0") is True and zero.take("part-1.txt@0") is None
    one.finish("part-1.txt@0")  # read whole: no other group reads it (its own may, where a position holds it)
    assert zero.take("part-1.txt@0") is False and one.take("part-1.txt@0") is True
    zero.finish("part-1.txt@0")  # (another group's part: nothing changes)
    assert store.get("part-1.txt@0") == b"1/done"


def test_a_part_under_way_at_a_group_silent_too_long_is_taken_over_from_its_start(store):
    now = [1000.0]
    zero, one = (PartClaims(store, group, lost_after=datetime.timedelta(seconds=60), clock=lambda: now[0])
                 for group in (0, 1))
    zero.alive()
    one.alive()
    assert one.take("part-0.txt") is True and one.take("part-1.txt") is True
    one.finish("part-1.txt")
    now[0] += 50
    zero.alive()
    assert zero.take("part-0.txt") is None  # group 1 said it was alive 50 s ago
    now[0] += 20
    assert zero.take("part-0.txt") is True and zero.take("part-1.txt") is False  # lost: its part under way only
    one.finish("part-0.txt")  # group 1 comes back and finishes it: group 0 reads it all the same
    assert store.get("part-0.txt") == b"0" and one.take("part-0.txt") is None


def test_a_part_under_way_at_a_group_the_coordinator_says_is_gone_is_taken_over_at_once(store, caplog):
    gone = set()
    zero, one = (PartClaims(store, group, gone=lambda: frozenset(gone)) for group in (0, 1))
    zero.alive()
    one.alive()
    assert one.take("part-0.txt") is True and one.take("part-1.txt") is True
    one.finish("part-1.txt")
    assert zero.take("part-0.txt") is None  # group 1 said it was alive just now, and is not gone
    gone.add(1)  # its last worker was lost, and none rejoined it for the coordinator's grace
    with caplog.at_level("WARNING", logger="paramserver.train.claims"):
        assert zero.take("part-0.txt") is True and zero.take("part-1.txt") is False  # its part under way only
    assert [r.getMessage() for r in caplog.records] == [
        "trainer group 0 takes over part-0.txt from trainer group 1, gone (no live worker, says the "
        "coordinator): read again from its start"]
    assert one.take("part-0.txt") is None  # a worker rejoining group 1 leaves it to group 0


def test_claims_belong_to_one_run_of_the_job(group_of_one):  # noqa: F811
    earlier, later = (PartClaims.of_job(group_of_one, run, 1) for run in (1, 2))
    assert earlier.take("part-0.txt")
    assert not PartClaims.of_job(group_of_one, 1, 0).take("part-0.txt")
    assert PartClaims.of_job(group_of_one, 2, 0).take("part-0.txt") and not later.take("part-0.txt")


def test_readers_of_two_groups_read_every_line_once_between_them_as_files_land(tmp_path, store):
    """Each reader is the only member of its group (every part of the input is its share); what one claims,
    the other leaves."""
    for index in range(6):
        land(tmp_path, f"part-{index}.txt", index * 100, 100)
    readers = [FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=4_000) for _ in range(2)]
    for group, reader in enumerate(readers):
        reader.claims = PartClaims(store, group)
    land(tmp_path, "part-6.txt", 600, 100)
    seen = read_all(readers, 700)
    assert sorted(seen) == list(range(700))
    keys = {part.key for reader in readers for part in reader.parts if part is not None}
    assert len(keys) == 7 and all(store.get(key) in (b"0/done", b"1/done") for key in keys)  # each read whole once


class Asked(PartClaims):
    """Group 0's claims, noting every part asked for."""

    def __init__(self, store, **options):
        super().__init__(store, 0, **options)
        self.asked = []

    def take(self, key):
        self.asked.append(key)
        return super().take(key)


def test_a_reader_whose_every_part_another_group_read_waits_without_reading_or_asking_again(tmp_path, store):
    for index in range(3):
        land(tmp_path, f"part-{index}.txt", index * 100, 100)
    reader = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=4_000)
    keys = sorted(part.key for part in reader.parts)
    other = PartClaims(store, 1)
    assert len(keys) == 3 and all(other.take(key) for key in keys)
    for key in keys:
        other.finish(key)
    reader.claims = Asked(store)
    assert read_all([reader], 1, within=1.0) == []
    assert sorted(reader.claims.asked) == keys  # once each, not at every listing
    assert read_all([reader], 1, within=0.5) == [] and len(reader.claims.asked) == 3  # nor at every iteration


def test_a_reader_asks_again_for_the_parts_under_way_elsewhere_and_reads_those_of_a_lost_group(tmp_path, store):
    for index in range(2):
        land(tmp_path, f"part-{index}.txt", index * 100, 100)
    reader = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=4_000)
    keys = sorted(part.key for part in reader.parts)
    now = [1000.0]
    other = PartClaims(store, 1, clock=lambda: now[0])
    other.alive()
    assert all(other.take(key) for key in keys)
    other.finish(keys[1])  # part-1 read whole by group 1, part-0 under way there
    reader.claims = Asked(store, lost_after=datetime.timedelta(seconds=60), clock=lambda: now[0])
    assert read_all([reader], 1, within=0.5) == []
    assert reader.claims.asked.count(keys[0]) > 1 and reader.claims.asked.count(keys[1]) == 1  # at each listing
    now[0] += 61  # group 1 is lost: its part under way is read again, from its start
    assert sorted(read_all([reader], 100)) == list(range(100))


def test_a_deal_takes_on_the_saved_parts_under_way_its_group_may_read_and_leaves_the_others_out():
    saved = [position(done=["f0", "f2"], key="f1", offset=40, rows=3), position(done=["f0", "f1"], key="f2")]
    others_group = {"f2"}
    dealt = deal([None], saved, 1, take=lambda key: key not in others_group)
    assert under_way(dealt[0]) == [("f1", 40, 3)]
    assert set(dealt[0]["done"]) == {"f0"}  # f2: neither under way here nor done (the other group reads it)
    members = deal([saved[1]], [saved[0]], 1, take=lambda key: False)  # a member's own part is never asked
    assert under_way(members[0]) == [("f2", 0, 0)] and set(members[0]["done"]) == {"f0"}


def test_two_groups_restored_from_one_checkpoint_read_every_line_once_between_them(tmp_path, store,
                                                                                      group_of_one):  # noqa: F811
    """A checkpoint holds two workers' positions, each in the middle of a part; the job starts again as two
    groups of one, each dealing those positions at its first formation."""
    from paramserver.train.data import BatchStream
    from paramserver.train.shares import GroupShares

    read, states = two_readers_part_way(tmp_path, [[3], [5]])
    saved = {0: {"used": 3, "state": states[0][0]}, 1: {"used": 5, "state": states[1][0]}}
    readers, streams = [], []
    for group in range(2):
        reader = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=2_000)
        reader.claims = PartClaims(store, group)
        stream = BatchStream(reader, None, prefetch=2, started=False)
        GroupShares(reader, stream, saved).formed(group_of_one, 5)
        readers.append(reader)
        streams.append(stream)
    rest = read_both(readers, streams, 240 - len(read))
    assert sorted(read + rest) == list(range(240))


def read_both(readers, streams, expected):
    """The lines of the batches ``streams`` give, taken in turn, until ``expected`` came (or 30 s passed); then
    nothing more may come."""
    seen = []
    deadline = time.monotonic() + 30
    while len(seen) < expected and time.monotonic() < deadline:
        for stream in streams:
            if stream.ready(1, 0.1):
                seen += [int(i) for i in stream.current().sparse["C1"].view(-1)]
                stream.finished()
    time.sleep(0.3)
    extra = [stream.ready(1, 0.3) for stream in streams]
    for reader in readers:
        reader.close()  # first: a stream's thread, waiting in the reader for files, ends with it
    for stream in streams:
        stream.close()
    assert not any(extra), "a line was left to read twice"
    return seen


def test_a_lost_members_part_its_reader_had_given_whole_is_read_on_by_its_own_group(tmp_path, store,
                                                                                    group_of_one):  # noqa: F811
    """The lost member's reader had given every row of its part under way to batches read ahead (so the part
    is marked done) when it died; the group had trained only some of them: the re-deal hands the rest to a
    survivor (a group's own part, done or not, is its own to read)."""
    def claims_of(states):
        claims = PartClaims(store, 0)
        for key, _, _ in under_way(states[1][0]):
            assert claims.take(key)
            claims.finish(key)
        return claims

    read, rest = lost_member_replayed(tmp_path, group_of_one, claims_of)
    assert sorted(read + rest) == list(range(240))


class _Coordinator:
    """The store a coordinator hosts: ``restart`` brings it back empty."""

    def __init__(self):
        self.store, self.starts = dist.HashStore(), 1

    def restart(self):
        self.store, self.starts = dist.HashStore(), self.starts + 1


class _Connection:
    """One member's connection to it (``ddp.group.JobStore``): an operation that finds the store started again
    connects again, calls back, and is tried again."""

    def __init__(self, coordinator):
        self._coordinator, self._starts, self._callbacks = coordinator, coordinator.starts, []

    def on_reconnect(self, callback):
        self._callbacks.append(callback)

    def __getattr__(self, name):
        def call(*args):
            if self._starts != self._coordinator.starts:
                self._starts = self._coordinator.starts
                for callback in self._callbacks:
                    callback()
            return getattr(self._coordinator.store, name)(*args)
        return call


def test_claims_are_published_again_in_a_store_that_came_back_with_its_coordinator(monkeypatch):
    from paramserver.train import claims
    coordinator = _Coordinator()
    zero, one = PartClaims(_Connection(coordinator), 0), PartClaims(_Connection(coordinator), 1)
    assert zero.take("part-a") is True and zero.take("part-b") is True
    zero.finish("part-a")
    coordinator.restart()  # empty now
    assert one.take("part-c") is None  # group 1 found it so first: it asks for nothing new for a while
    zero.alive()  # group 0's next agreement: its claims are back
    monkeypatch.setattr(claims, "REPUBLISH_WINDOW", datetime.timedelta(0))
    assert one.take("part-a") is False  # read whole by group 0: never read again
    assert one.take("part-b") is None  # under way at group 0
    assert one.take("part-c") is True
