"""Online training stops when asked while it waits for data: a job following an input where nothing lands
returns at its next agreement after a stop request (``ps-ctl shutdown`` and SIGTERM reach a job as that
request), having waited in bounded polls, not in a step's collective.

Its own module: the stop request stays set on the context, so no other test may share it.
"""

import contextlib
import logging
import threading

import pytest

from paramserver.runtime.context import JobContext

pytestmark = pytest.mark.timeout(120)


class StopOnWait(logging.Handler):
    """Asks ``ctx``'s job to stop once its group agreed to wait for data (``waits``: that line); ``shortened``:
    the lines of the windows its group took short of data."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx, self.waited = ctx, threading.Event()
        self.waits, self.shortened = [], []

    def emit(self, record):
        message = record.getMessage()
        if "the group takes steps" in message:
            self.shortened.append(message)
        if "waits for its group's data" in message and not self.waited.is_set():
            self.waits.append(message)
            self.waited.set()
            self.ctx.inbox.request_stop()


@contextlib.contextmanager
def stopping_when_waiting(ctx):
    """The Trainer's log watched meanwhile: ``ctx``'s job is asked to stop once its group agreed to wait;
    yields the handler (``waited``: it did)."""
    trainer_log = logging.getLogger("paramserver.train.trainer")
    handler, level = StopOnWait(ctx), trainer_log.level
    trainer_log.addHandler(handler)
    trainer_log.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        trainer_log.removeHandler(handler)
        trainer_log.setLevel(level)


def test_a_job_waiting_for_files_that_never_land_stops_when_asked(tmp_path):
    from test_data_files import line, write
    from paramserver.jobs import ctr

    write(tmp_path / "day_0.txt", [line(i) for i in range(10 * 256)])  # 10 steps, then nothing more lands
    ctx = JobContext.local()
    try:
        with stopping_when_waiting(ctx) as handler:
            data = {"format": "criteo", "train": str(tmp_path), "follow": True, "poll_seconds": 0.2}
            result = ctr.main(ctx, table_name="ctr-stop", steps=10 ** 6, batch_size=256, hook="allreduce",
                              eval_every=10 ** 9, log_every=10 ** 9, data=data)
    finally:
        ctx.close()
    assert handler.waited.is_set()
    assert result["steps"] == 10 and result["sparse_steps"] == 10, result


class Feed:
    """Batches of one fixed table that arrive as a test puts them (``land``), as a followed input's do; an
    iteration waits for the next in bounded polls until ``close()``."""

    def __init__(self):
        import queue
        self._queue, self._closed = queue.Queue(), threading.Event()

    def land(self, count: int) -> None:
        import torch
        from paramserver import Batch
        for index in range(count):
            ids = torch.full((4, 1), index % 10)
            self._queue.put(Batch(sparse={"t": ids}, dense=torch.zeros(4, 1),
                                  labels=torch.tensor([0.0, 1.0, 0.0, 1.0])))

    def close(self) -> None:
        self._closed.set()

    def __iter__(self):
        import queue
        while not self._closed.is_set():
            try:
                yield self._queue.get(timeout=0.1)
            except queue.Empty:
                continue


def test_reads_ahead_past_an_agreement_never_wait_for_data_that_has_not_landed():
    """Fixed tables read ahead across agreements; the batch past one that has not landed is not waited for
    in the step before (where the group would sit in its all-reduce): the group agrees to wait, and stops."""
    import torch
    from paramserver import Table, Trainer
    from paramserver.optim import QHM
    from test_trainer import Logit

    feed = Feed()
    feed.land(10)
    ctx = JobContext.local()
    try:
        with stopping_when_waiting(ctx) as handler:
            trainer = Trainer(ctx, tables={"t": Table(10, 4)}, dense=Logit(),
                              sparse_optimizer=(QHM, dict(lr=0.1, momentum=0.9, nu=0.7)),
                              dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                              loss=torch.nn.BCEWithLogitsLoss(), name="fixed-feed", staleness=1)
            figures = trainer.fit(feed, steps=10 ** 6, log_every=10 ** 9)
    finally:
        feed.close()
        ctx.close()
    assert handler.waited.is_set()
    assert figures["steps"] == 10 and figures["sparse_steps"] == 10, figures


@pytest.mark.parametrize("rows", [10, None], ids=["fixed", "dynamic"])
def test_what_landed_is_trained_on_before_the_group_waits_for_more(rows):
    """13 batches land and no more: the group agrees (every 10 steps) at step 10 with 3 of the window's
    batches in hand, takes those 3 steps at once and agrees again at 13, where it waits (and is stopped).
    The last batches of a file are not held back until the next file lands."""
    import torch
    from paramserver import Table, Trainer
    from paramserver.optim import QHM
    from test_trainer import Logit

    feed = Feed()
    feed.land(13)
    ctx = JobContext.local()
    try:
        with stopping_when_waiting(ctx) as handler:
            trainer = Trainer(ctx, tables={"t": Table(rows, 4)}, dense=Logit(),
                              sparse_optimizer=(QHM, dict(lr=0.1, momentum=0.9, nu=0.7)),
                              dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                              loss=torch.nn.BCEWithLogitsLoss(), name=f"tail-{rows}", staleness=1)
            figures = trainer.fit(feed, steps=10 ** 6, log_every=10 ** 9)
    finally:
        feed.close()
        ctx.close()
    assert handler.waits and "step 13 waits" in handler.waits[0], handler.waits
    # (Under load the reader may pause between two of the 3 batches: then the window is cut shorter still.)
    assert handler.shortened and handler.shortened[0].startswith("worker0: the group takes steps 10 to "), \
        handler.shortened
    assert figures["steps"] == 13 and figures["sparse_steps"] == 13, figures
