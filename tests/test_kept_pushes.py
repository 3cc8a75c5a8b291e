"""Pushes that fail against a lost shard, in one process on fake collections (``RowPipeline``): kept, sent again
after the sparse part is rebuilt to the shards they failed against only, and counted applied; kept again when
they fail again and lost when the worker ends; a refusal lost at once; and the steps a shard that came back no
longer holds (its ledger) moved from applied to lost, each once."""

import logging

import pytest
import torch

from paramserver.shards.client.collection import PendingPush, ShardRequestFailed, StepPush
from paramserver.train.acked import AckedSteps, describe_steps
from paramserver.train.pipeline import RowPipeline


class FakeCollection:
    """A collection over shards named by ``incarnations`` (shard -> process): ``send`` answers at once, failing
    on the shards ``failing`` names (shard -> the error); ``push_ledgers`` answers ``ledgers``."""

    def __init__(self, incarnations, failing=None, ledgers=None):
        self._incarnations = dict(incarnations)
        self.failing, self.ledgers = dict(failing or {}), dict(ledgers or {})
        self.sent, self.asked = [], []

    def incarnations(self):
        return dict(self._incarnations)

    def push_ledgers(self, shards):
        self.asked.extend(shards)
        return {shard: self.ledgers.get(shard, (-1, 0)) for shard in shards}

    def send(self, pushes, then=None):
        self.sent.append([(push.step, sorted(push.by_shard)) for push in pushes])
        futures = {}
        for shard in dict.fromkeys(shard for push in pushes for shard in push.by_shard):
            futures[shard] = torch.futures.Future()
            if shard in self.failing:
                futures[shard].set_exception(self.failing[shard])
            else:
                futures[shard].set_result(None)
        return PendingPush(futures, None, [push.step for push in pushes], pushes)


class Made:
    """A push made during a backward pass (``PushOnGradients``, as the pipeline reads it): sent as ``message``, or
    failing to leave with ``error`` (``unsent``: what it was to carry)."""

    holding, held = False, None

    def __init__(self, message=None, error=None, unsent=()):
        self.message, self.error, self.unsent = message, error, list(unsent)

    def sent(self):
        if self.error is not None:
            raise self.error
        return self.message


def push(collection, step, *shards):
    """Step ``step``'s push, with rows on ``shards``."""
    return StepPush(collection, step, {shard: ([0], [torch.tensor([step])], [torch.ones(1, 2)])
                                       for shard in shards})


def pipeline(staleness=0):
    return RowPipeline(staleness, lambda offset: None, {}, lambda: 1000, 1000)


def send(pipe, collection, *pushes):
    """The pushes in one message, as the step of the last makes it; the failures the pipeline returns."""
    return pipe.pushed(pushes[-1].step, Made(collection.send(list(pushes))))


def test_a_push_failed_against_a_lost_shard_is_sent_again_after_the_rebuild_to_that_shard_only():
    old = FakeCollection({"a": 1, "b": 1}, failing={"b": RuntimeError("shard b lost")})
    pipe = pipeline()
    failures = send(pipe, old, push(old, 0, "a", "b"), push(old, 1, "a"))
    # Step 0's part on b failed: kept; step 1 has nothing on b: applied.
    assert [step for step, _ in failures] == [0] and isinstance(failures[0][1], ShardRequestFailed)
    assert failures[0][1].refusal() is None
    assert pipe.kept(0) and not pipe.kept(1) and (pipe.applied, pipe.lost) == (1, 0)
    assert pipe.drain() == []  # nothing in flight: the kept push waits for the rebuild
    new = FakeCollection({"a": 1, "b": 2}, ledgers={"b": (-1, 3)})
    assert pipe.rebuilt(old, new) == []
    assert new.asked == ["b"]  # only the shard served by another process tells its ledger
    assert new.sent == [[(0, ["b"])]]  # to b alone, through the new collection
    assert (pipe.applied, pipe.lost, pipe.replayed) == (2, 0, 3) and not pipe.kept(0)
    # Another rebuild with the same processes asks no ledger and sends nothing.
    again = FakeCollection({"a": 1, "b": 2})
    assert pipe.rebuilt(new, again) == [] and again.asked == [] and again.sent == []


def test_a_push_failing_again_is_kept_again_in_step_order_and_lost_when_the_worker_ends():
    old = FakeCollection({"a": 1, "b": 1}, failing={"b": RuntimeError("shard b lost")})
    pipe = pipeline(staleness=1)
    assert send(pipe, old, push(old, 3, "b")) == []  # in flight (staleness 1): waited for after step 4
    failures = send(pipe, old, push(old, 4, "a", "b")) + pipe.drain()
    assert sorted(step for step, _ in failures) == [3, 4] and pipe.kept(3) and pipe.kept(4)
    lost_again = FakeCollection({"a": 1, "b": 2}, failing={"b": RuntimeError("shard b lost again")})
    assert [step for step, _ in pipe.rebuilt(old, lost_again)] == [3, 4]
    assert lost_again.sent == [[(3, ["b"]), (4, ["b"])]]  # one message, in step order, to b only
    assert pipe.kept(3) and pipe.kept(4) and (pipe.applied, pipe.lost) == (0, 0)
    pipe.abandon()  # the rebuilds' bound reached, or the worker stops: what is still kept is lost
    assert not pipe.kept(3) and (pipe.applied, pipe.lost) == (0, 2)


def test_a_push_sent_again_after_a_second_loss_is_applied_by_the_shard_that_came_back():
    old = FakeCollection({"a": 1}, failing={"a": RuntimeError("lost")})
    pipe = pipeline()
    send(pipe, old, push(old, 0, "a"))
    failing = FakeCollection({"a": 2}, failing={"a": RuntimeError("lost again")})
    assert pipe.rebuilt(old, failing) and pipe.kept(0)
    served = FakeCollection({"a": 3}, ledgers={"a": (-1, 0)})
    assert pipe.rebuilt(failing, served) == [] and served.sent == [[(0, ["a"])]]
    assert (pipe.applied, pipe.lost) == (1, 0)


def test_a_refused_push_is_lost_at_once_and_so_is_one_refused_when_sent_again():
    refusing = FakeCollection({"a": 1}, failing={"a": ValueError("rows out of range")})
    pipe = pipeline()
    failures = send(pipe, refusing, push(refusing, 0, "a"))
    assert [step for step, _ in failures] == [0] and failures[0][1].refusal() is not None
    assert not pipe.kept(0) and (pipe.applied, pipe.lost) == (0, 1)
    old = FakeCollection({"a": 1, "b": 1}, failing={"b": RuntimeError("lost")})
    send(pipe, old, push(old, 1, "a", "b"))
    refused_again = FakeCollection({"a": 1, "b": 2}, failing={"b": ValueError("an optimizer that cannot")})
    failures = pipe.rebuilt(old, refused_again)
    assert [step for step, _ in failures] == [1] and failures[0][1].refusal() is not None
    assert not pipe.kept(1) and (pipe.applied, pipe.lost) == (0, 2)


def test_a_message_that_could_not_leave_is_kept_whole_and_a_negative_step_never_is():
    collection = FakeCollection({"a": 1, "b": 1})
    pipe = pipeline()
    failures = pipe.pushed(5, Made(error=RuntimeError("unknown destination"), unsent=[push(collection, 5, "a", "b")]))
    # Which shards got it is not known: every shard of it again (idempotent).
    assert [step for step, _ in failures] == [5] and pipe.kept(5)
    # A push that was never made (making it failed) has nothing to send again: lost.
    assert [step for step, _ in pipe.pushed(6, Made(error=RuntimeError("no rows"), unsent=[]))] == [6]
    assert not pipe.kept(6) and (pipe.applied, pipe.lost) == (0, 1)
    new = FakeCollection({"a": 1, "b": 1})
    assert pipe.rebuilt(collection, new) == [] and new.sent == [[(5, ["a", "b"])]]
    failing = FakeCollection({"a": 1}, failing={"a": RuntimeError("lost")})
    assert send(pipe, failing, push(failing, -1, "a")) and not pipe.kept(-1)  # (not idempotent)
    assert (pipe.applied, pipe.lost) == (1, 2)


def test_steps_a_shard_that_came_back_no_longer_holds_move_from_applied_to_lost_each_once(caplog):
    old = FakeCollection({"a": 1, "b": 1})
    pipe = pipeline()
    for step in range(8):
        assert send(pipe, old, push(old, step, "a", "b") if step != 6 else push(old, step, "b")) == []
    assert (pipe.applied, pipe.lost) == (8, 0)
    # a's new process replayed its log up to step 4 (3 pushes since its checkpoint); b's restored a checkpoint
    # holding steps up to 1 and nothing more.  Steps 5 and 7 (a) and 2 to 7 (b): 2 to 7 lost, each once.
    new = FakeCollection({"a": 2, "b": 2}, ledgers={"a": (4, 3), "b": (1, 0)})
    with caplog.at_level(logging.WARNING, logger="paramserver.train.pipeline"):
        assert pipe.rebuilt(old, new) == []
    assert (pipe.applied, pipe.lost, pipe.replayed) == (2, 6, 3)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert "shard a came back without the pushes of 2 steps it had applied (steps 5, 7;" in lines[0], lines
    assert "shard b came back without the pushes of 6 steps it had applied (steps 2-7;" in lines[1], lines
    # a comes back again holding steps up to 1: its steps 2 to 4 are lost, counted already with b's.
    newer = FakeCollection({"a": 3, "b": 2}, ledgers={"a": (1, 0)})
    assert pipe.rebuilt(new, newer) == [] and (pipe.applied, pipe.lost) == (2, 6)
    # and again holding nothing: steps 0 and 1 go too.
    newest = FakeCollection({"a": 4, "b": 2}, ledgers={"a": (-1, 0)})
    assert pipe.rebuilt(newer, newest) == [] and (pipe.applied, pipe.lost) == (0, 8)


def test_a_kept_step_rolled_back_on_another_shard_is_lost_once_sent_again():
    old = FakeCollection({"a": 1, "b": 1}, failing={"b": RuntimeError("lost")})
    pipe = pipeline()
    send(pipe, old, push(old, 0, "a", "b"))
    new = FakeCollection({"a": 2, "b": 2}, ledgers={"a": (-1, 0)})  # a lost its part of step 0 too
    assert pipe.rebuilt(old, new) == [] and new.sent == [[(0, ["b"])]]
    assert (pipe.applied, pipe.lost) == (0, 1)


@pytest.mark.parametrize("max_runs", [2, 4096])
def test_acked_steps_follow_runs_of_steps_per_shard_within_their_bound(max_runs):
    acked = AckedSteps(max_runs=max_runs)
    for step in (0, 1, 2, 5, 6, 9, 4, 3, -1):
        acked.add("a", step)
    expected = [0, 1, 2, 3, 4, 5, 6, 9]
    # Within a bound of two runs, 0-2 was forgotten as 9 made a third (0-2, 5-6, 9); 3 and 4 came after.
    assert acked.steps("a") == (expected if max_runs > 2 else [3, 4, 5, 6, 9])
    acked.add("a", 11)  # a third run: past a bound of 2 the oldest is forgotten
    assert acked.steps("a") == ([9, 11] if max_runs == 2 else expected + [11])
    assert acked.through("a") == 11 and acked.through("b") == -1
    acked.forget([11])
    assert acked.rolled_back("a", 3) == ([9] if max_runs == 2 else [4, 5, 6, 9])
    assert describe_steps([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"
