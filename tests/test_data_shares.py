"""Dealing a followed input's parts to a group (``paramserver.data.shares``), readers re-dealt mid-stream, and
a trainer group's side of it (``paramserver.train.shares``: a lost member's position replayed, a member that
missed a deal, a restore): every line is read once over the members, whoever joins or leaves (one process;
the group's side in a trainer group of one)."""

import threading
import time

import pytest

from paramserver.data import FileReader
from paramserver.data.shares import again, deal, owner, under_way

from test_data_follow import POLL, land, take


def position(done=(), key="", offset=0, rows=0, held=(), malformed=0):
    return {"epoch": 0, "part": 0, "offset": offset, "rows": rows, "malformed": malformed, "done": tuple(done),
            "key": key, "held": tuple(held)}


def test_members_keep_their_parts_under_way_and_the_rest_goes_by_hash():
    a = position(done=["f0"], key="f1", offset=40, rows=3, malformed=2)
    b = position(done=["f2", "f1"], key="f3", offset=10)  # f1: under way at a's when b was dealt
    dealt = deal([a, b, None], [])
    assert [under_way(state) for state in dealt] == [[("f1", 40, 3)], [("f3", 10, 0)], []]
    for rank, state in enumerate(dealt):  # done: what was read whole, and what another member has under way
        assert set(state["done"]) == {"f0", "f2", "f1", "f3"} - {key for key, _, _ in under_way(state)}
    assert [state["malformed"] for state in dealt] == [2, 0, 0]


def test_the_highest_done_below_is_dealt_and_the_parts_done_below_it_are_forgotten():
    a = dict(position(done=["f1", "f2", "f4"], key="f5"), done_below="f2")
    b = dict(position(done=["f1", "f5"], key="f0", offset=30), done_below="f3")  # f0: under way, kept
    dealt = deal([a, b], [])
    assert [state["done_below"] for state in dealt] == ["f3", "f3"]
    assert [set(state["done"]) for state in dealt] == [{"f4", "f0"}, {"f4", "f5"}]
    assert [under_way(state) for state in dealt] == [[("f5", 0, 0)], [("f0", 30, 0)]]
    assert deal([position(done=["f1"])], [])[0]["done_below"] == ""  # a position saved before it had one


def test_a_lost_readers_part_under_way_goes_to_the_member_its_name_hashes_to():
    lost = position(done=["f0"], key="f5", offset=7, rows=1, held=[("f6", 3, 0)])
    member = position(done=["f0", "f2"])
    dealt = deal([member, None], [lost])
    for key, offset, rows in under_way(lost):
        taker = owner(key, 2)
        assert (key, offset, rows) in under_way(dealt[taker])
        assert key in dealt[1 - taker]["done"]
    assert {"f0", "f2"} <= set(dealt[0]["done"]) & set(dealt[1]["done"])


def test_a_part_under_way_twice_is_taken_from_where_it_is_furthest_on():
    older, newer = position(key="f1", offset=10), position(key="f1", offset=90, rows=2)
    dealt = deal([None], [older, newer])
    assert under_way(dealt[0]) == [("f1", 90, 2)] and "f1" not in dealt[0]["done"]


def test_a_batch_read_again_keeps_the_parts_it_began_whatever_the_deal():
    before = position(done=["f0"], key="f1", offset=40, rows=3)
    after = position(done=["f0", "f1", "f2"], key="f3", offset=0, rows=5)  # the batch ran through f2 into f3
    kept = again(before, after)
    assert under_way(kept) == [("f1", 40, 3), ("f2", 0, 0), ("f3", 0, 0)]
    assert again(before, position(done=["f0"], key="f1", offset=80)) == before
    dealt = deal([kept, None], [])
    assert under_way(dealt[0]) == under_way(kept) and {"f1", "f2", "f3"} <= set(dealt[1]["done"])


def test_a_fixed_inputs_position_is_refused():
    with pytest.raises(ValueError, match="not a followed input's position"):
        deal([None], [{"epoch": 0, "part": 3}])


def read_all(readers, expected: int, within: float = 30):
    """Every reader iterated in a thread until ``expected`` lines came over all of them; their first ids."""
    seen, lock = [], threading.Lock()

    def run(reader):
        for batch in reader:
            with lock:
                seen.extend(int(i) for i in batch.sparse["C1"].view(-1))

    threads = [threading.Thread(target=run, args=(reader,), daemon=True) for reader in readers]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + within
    while len(seen) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # anything read twice would show up by now
    for reader in readers:
        reader.close()
    for thread in threads:
        thread.join(5)
    return seen


def test_readers_re_dealt_mid_stream_read_every_line_once(tmp_path):
    """Three readers, each in the middle of a part; one leaves (its position handed on), one joins."""
    for index in range(8):
        land(tmp_path, f"part-{index}.txt", index * 100, 100)
    readers = [FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=4_000, worker=w, workers=3)
               for w in range(3)]
    head, states = [], []
    for reader in readers:
        batches = iter(reader)
        if reader.parts:
            head += take(batches, 5)  # 50 lines: in the middle of its first part, and of a chunk
        states.append(reader.state_dict())
        assert not reader.parts or states[-1]["rows"] > 0, states[-1]
        batches.close()
    # reader 1 leaves; a new member joins: two members, a lost position
    dealt = deal([states[0], states[2], None], [states[1]])
    for rank, reader in enumerate((readers[0], readers[2])):
        reader.reshare(rank, 3, dealt[rank])
    joiner = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=4_000)
    joiner.reshare(2, 3, dealt[2])
    land(tmp_path, "part-8.txt", 800, 100)  # lands meanwhile: dealt by the new rule
    rest = read_all([readers[0], readers[2], joiner], 900 - len(head))
    assert sorted(head + rest) == list(range(900))


@pytest.fixture
def group_of_one():
    """A trainer group of one (``worker0``), over gloo in this process."""
    from paramserver.ddp import TrainerGroup
    from paramserver.runtime.context import JobContext
    ctx = JobContext.local()
    group = TrainerGroup.join(ctx.group)
    yield group
    group.close()
    ctx.close()


def two_readers_part_way(folder, reads):
    """Readers 0 and 1 of 2 over 6 files of 40 lines; reader ``r`` reads ``reads[r]`` batches of 10 (a list of
    counts: its state after each count is kept).  Returns (lines read, states per reader)."""
    for index in range(6):
        land(folder, f"part-{index}.txt", index * 40, 40)
    read, states = [], []
    for worker, counts in enumerate(reads):
        reader = FileReader(str(folder), 10, follow=True, poll=POLL, chunk_bytes=2_000, worker=worker, workers=2)
        batches, kept = iter(reader), []
        for count in counts:
            read += take(batches, count)
            kept.append(reader.state_dict())
        batches.close()
        states.append(kept)
    return read, states


def read_rest(shares_reader, stream, expected):
    """The batches ``stream`` gives until ``expected`` lines came (or none came for a while)."""
    seen = []
    deadline = time.monotonic() + 30
    while len(seen) < expected and time.monotonic() < deadline:
        if stream.ready(1, 0.5):
            seen += [int(i) for i in stream.current().sparse["C1"].view(-1)]
            stream.finished()
    time.sleep(0.3)
    extra = stream.ready(1, 0.5)
    shares_reader.close()  # first: the stream's thread, waiting in the reader for files, ends with it
    stream.close()
    assert not extra, "a line was left to read twice"
    return seen


def lost_member_replayed(folder, group, claims_of=lambda states: None):
    """worker0 told its position at step 10 (2 batches read), the lost member too (1 batch read); the lost
    member then trained steps 10 and 11 (2 more batches) and died: the group of one (``group``) re-forms at
    step 12, its reader's ``claims`` what ``claims_of(states)`` gives.  The lines read before, and after."""
    from paramserver.train.data import BatchStream
    from paramserver.train.shares import GroupShares, Snapshot

    read, states = two_readers_part_way(folder, [[2], [1, 2]])
    reader = FileReader(str(folder), 10, follow=True, poll=POLL, chunk_bytes=2_000)
    reader.claims = claims_of(states)
    stream = BatchStream(reader, {"used": 10, "state": states[0][0]}, prefetch=2, started=False)
    shares = GroupShares(reader, stream)
    shares.snapshot = Snapshot(10, {"worker0": {"state": states[0][0], "worker": 0, "workers": 2},
                                    "lost": {"state": states[1][0], "worker": 1, "workers": 2}})
    shares.formed(group, 12)
    return read, read_rest(reader, stream, 240 - len(read))


def test_a_lost_members_position_is_replayed_over_the_steps_its_group_completed(tmp_path, group_of_one):
    read, rest = lost_member_replayed(tmp_path, group_of_one)
    assert sorted(read + rest) == list(range(240))


def test_a_lost_member_that_sat_out_uneven_steps_is_replayed_over_the_batches_it_had(tmp_path, group_of_one):
    """The lost member told at step 10 that it had a batch for step 10 only (``until`` 11): it trained step 10
    (one more batch), sat out steps 11 and 12 while worker0 trained them, and died; the group re-forms at step
    13.  Its replay reads the one batch it took, not three (their lines would be taken as read, and lost)."""
    from paramserver.train.data import BatchStream
    from paramserver.train.shares import GroupShares, Snapshot

    read, states = two_readers_part_way(tmp_path, [[2], [1, 1]])
    reader = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=2_000)
    stream = BatchStream(reader, {"used": 10, "state": states[0][0]}, prefetch=2, started=False)
    shares = GroupShares(reader, stream)
    shares.snapshot = Snapshot(10, {"worker0": {"state": states[0][0], "worker": 0, "workers": 2, "until": 20},
                                    "lost": {"state": states[1][0], "worker": 1, "workers": 2, "until": 11}})
    shares.formed(group_of_one, 13)
    rest = read_rest(reader, stream, 240 - len(read))
    assert sorted(read + rest) == list(range(240))


def test_a_member_that_missed_the_last_deal_is_dealt_from_the_dealers_snapshot_of_it(tmp_path, group_of_one):
    """worker0's reader still follows the deal before (generation 0: that formation's broadcast never reached
    it); the dealer's snapshot holds what the last deal gave it (here: its parts and the lost member's)."""
    from paramserver.data.shares import deal as deal_positions
    from paramserver.train.data import BatchStream
    from paramserver.train.shares import GroupShares, Snapshot

    read, states = two_readers_part_way(tmp_path, [[2], [3]])
    last_deal = deal_positions([states[0][0]], [states[1][0]])[0]
    reader = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=2_000, worker=0, workers=2)
    stream = BatchStream(reader, {"used": 2, "state": states[0][0]}, prefetch=2, started=False)
    shares = GroupShares(reader, stream)
    shares.deal = 0
    shares.snapshot = Snapshot(7, {"worker0": {"state": last_deal, "worker": 0, "workers": 1, "deal": 1}})
    shares.formed(group_of_one, 7)
    rest = read_rest(reader, stream, 240 - len(read))
    assert sorted(read + rest) == list(range(240))


def test_a_restore_deals_every_saved_position_to_the_group_whatever_its_size(tmp_path, group_of_one):
    from paramserver.train.data import BatchStream
    from paramserver.train.shares import GroupShares

    read, states = two_readers_part_way(tmp_path, [[3], [5]])
    reader = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=2_000)
    stream = BatchStream(reader, None, prefetch=2, started=False)
    shares = GroupShares(reader, stream, {0: {"used": 3, "state": states[0][0]}, 1: {"used": 5, "state": states[1][0]}})
    shares.formed(group_of_one, 5)
    rest = read_rest(reader, stream, 240 - len(read))
    assert sorted(read + rest) == list(range(240))


def test_a_batch_stream_restarted_mid_stream_reads_on_from_where_it_is_put(tmp_path):
    """Batches read ahead are dropped; the reader, stopped while it waits for files, reads on from the position
    it is given (here: the stream's own, re-dealt to the same share)."""
    from paramserver.train.data import BatchStream
    for index in range(3):
        land(tmp_path, f"part-{index}.txt", index * 40, 40)
    reader = FileReader(str(tmp_path), 10, follow=True, poll=POLL, chunk_bytes=2_000)
    stream = BatchStream(reader, prefetch=2)
    seen = []
    for _ in range(5):
        seen += [int(i) for i in stream.current().sparse["C1"].view(-1)]
        stream.finished()
    assert stream.ready(3, 5.0) and len(stream) == 3  # read ahead, to be dropped
    stream.restart(lambda: reader.reshare(0, 1, stream.position()["state"]))
    assert len(stream) == 0
    rest = read_rest(reader, stream, 120 - len(seen))
    assert seen + rest == list(range(120))
