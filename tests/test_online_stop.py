"""Online training stops when asked while it waits for data: a job following an input where nothing lands
returns at its next agreement after a stop request (``ps-ctl shutdown`` and SIGTERM reach a job as that
request), having waited in bounded polls, not in a step's collective.

Its own module: the stop request stays set on the context, so no other test may share it.
"""

import logging
import threading

import pytest

from paramserver.runtime.context import JobContext

pytestmark = pytest.mark.timeout(120)


class StopOnWait(logging.Handler):
    """Asks ``ctx``'s job to stop once its group agreed to wait for data."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx, self.waited = ctx, threading.Event()

    def emit(self, record):
        if "waits for its group's data" in record.getMessage() and not self.waited.is_set():
            self.waited.set()
            self.ctx.inbox.request_stop()


def test_a_job_waiting_for_files_that_never_land_stops_when_asked(tmp_path):
    from test_data_files import line, write
    from paramserver.jobs import ctr

    write(tmp_path / "day_0.txt", [line(i) for i in range(10 * 256)])  # 10 steps, then nothing more lands
    ctx = JobContext.local()
    trainer_log = logging.getLogger("paramserver.train.trainer")
    handler, level = StopOnWait(ctx), trainer_log.level
    trainer_log.addHandler(handler)
    trainer_log.setLevel(logging.INFO)
    try:
        data = {"format": "criteo", "train": str(tmp_path), "follow": True, "poll_seconds": 0.2}
        result = ctr.main(ctx, table_name="ctr-stop", steps=10 ** 6, batch_size=256, hook="allreduce",
                          eval_every=10 ** 9, log_every=10 ** 9, data=data)
    finally:
        trainer_log.removeHandler(handler)
        trainer_log.setLevel(level)
        ctx.close()
    assert handler.waited.is_set()
    assert result["steps"] == 10 and result["sparse_steps"] == 10, result
