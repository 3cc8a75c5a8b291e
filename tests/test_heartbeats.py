"""The heartbeat loop's ends, against a fake coordinator: refused at the first refusal (once, whoever beat),
lost at the end of its grace for an unreachable coordinator (not a beat later), and an outage shorter than the
grace ridden out with retries, said once when it starts and once when it ends."""

import datetime
import threading
import time

import grpc

from paramserver.control import CoordinatorError, CoordinatorUnavailable, HeartbeatLoop, pb

INTERVAL = datetime.timedelta(seconds=0.2)


class FakeCoordinator:
    """Answers heartbeats until told to refuse them or to be unreachable."""

    def __init__(self):
        self.failure = None
        self.calls = 0

    def call(self, method, request, timeout=None):
        assert method == "Heartbeat"
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        return pb.HeartbeatResponse(generation=1)


def _loop(coordinator, give_up_after, interval=INTERVAL):
    ends = []
    ended = threading.Event()

    def on_lost(reason, refused):
        ends.append((reason, refused, time.monotonic()))
        ended.set()

    loop = HeartbeatLoop(coordinator, "member-1", interval, give_up_after, progress=lambda: (0, {}),
                         on_command=lambda command: None, on_lost=on_lost)
    return loop, ends, ended


def test_a_refused_member_is_lost_at_the_first_refusal_once_whoever_beat():
    coordinator = FakeCoordinator()
    loop, ends, ended = _loop(coordinator, datetime.timedelta(seconds=5))
    loop.start()
    coordinator.failure = CoordinatorError("member-1 is dead (no heartbeat for 5.2 s); join again",
                                           grpc.StatusCode.FAILED_PRECONDITION)
    for _ in range(3):  # the job asks for news while the loop beats too
        try:
            loop.beat()
        except CoordinatorError:
            pass
    assert ended.wait(2)
    time.sleep(3 * INTERVAL.total_seconds())
    assert len(ends) == 1 and ends[0][1] is True and "is dead" in ends[0][0], ends
    calls = coordinator.calls
    time.sleep(3 * INTERVAL.total_seconds())
    assert coordinator.calls == calls  # the loop ended: no more beats against a cluster that refused us
    loop.stop()


def test_an_unreachable_coordinator_is_given_up_at_the_timeout():
    coordinator = FakeCoordinator()
    interval, give_up_after = datetime.timedelta(seconds=1), datetime.timedelta(seconds=1.5)
    loop, ends, ended = _loop(coordinator, give_up_after, interval)
    loop.start()
    time.sleep(0.2)
    coordinator.failure = CoordinatorUnavailable("coordinator at 127.0.0.1:1 unreachable for Heartbeat",
                                                 grpc.StatusCode.UNAVAILABLE)
    unreachable_since = time.monotonic()
    assert ended.wait(5)
    (reason, refused, at), = ends
    assert not refused and reason.startswith("lost the coordinator: unreachable for"), reason
    # Declared at the timeout (from the last good beat), not at the first beat after it (up to 2.5 s here).
    assert at - unreachable_since < give_up_after.total_seconds() + interval.total_seconds() / 2, \
        at - unreachable_since
    loop.stop()


def test_an_outage_shorter_than_the_grace_is_ridden_out_said_once_when_it_starts_and_once_when_it_ends(caplog):
    coordinator = FakeCoordinator()
    loop, ends, ended = _loop(coordinator, datetime.timedelta(seconds=5), interval=datetime.timedelta(seconds=1))
    with caplog.at_level("INFO", logger="paramserver.control.client"):
        loop.start()
        time.sleep(0.3)
        coordinator.failure = CoordinatorUnavailable("coordinator 127.0.0.1:1 unreachable for Heartbeat",
                                                     grpc.StatusCode.UNAVAILABLE)
        calls = coordinator.calls
        time.sleep(2.5)
        retried = coordinator.calls - calls
        assert loop.outage is not None
        coordinator.failure = None
        time.sleep(1.5)
    assert not ended.is_set() and loop.outage is None
    # The first failed beat within the 1 s interval, then retries 0.2, 0.4, 0.8 s later (backoff up to the
    # interval): 3 to 5 in 2.5 s, where beats at the interval would be 2 or 3.
    assert 3 <= retried <= 5, retried
    lines = [r.getMessage() for r in caplog.records]
    assert sum("going on without it for up to 5 s" in line for line in lines) == 1, lines
    assert sum("the outage lasted" in line for line in lines) == 1, lines
    loop.stop()
