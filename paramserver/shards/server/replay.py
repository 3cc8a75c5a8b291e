"""Replaying a shard's push log: an optimizer made by a restarted shard process is brought to where the killed
process left it.

Owns ``replay``: when a trainer asks a restarted shard for its optimizer
(``optimizers.owner_optimizer_for``, after the checkpoint's rows and state
were restored), the records of the push log (``push_log``) that follow the
point where that optimizer's rows were those of the checkpoint are applied
again, in order, through the same step a push takes (``apply_rows``, with
its ``(pusher, step)``, so that its ledger knows them too), and a dynamic
table's lookups admit, touch and evict again.  Nothing of it is logged a
second time: the records are in the log already.  When the log holds no
such point (it was cut at a later checkpoint, began at another, a gap
follows, or it was damaged), the rows stay the checkpoint's and one line
says so; a mark written then makes the log whole again from there.  A
replay that fails part way (its rows then held by no process) sets the log
aside and ends the process as a shard fault does: the one restarted next
restores its checkpoint alone, and the trainers count what it rolled back.
"""

import logging
import time
from typing import Dict

from ...logs import one_line
from .push_log import Lookup
from .state import ShardState

logger = logging.getLogger(__name__)

REPLAY_PEER = "push log"


def replay(state: ShardState, optimizer) -> int:
    """Apply again the pushes (and dynamic lookups) of ``optimizer``'s tables that ``state``'s push log holds
    since the checkpoint its rows came from; returns how many records were applied."""
    log = state.push_log
    if log is None:
        return 0
    checkpoint = state.restored_key()
    dynamic = {rows.log_tag: rows for rows in optimizer.dynamic_parts() if rows is not None}
    plan = log.plan(checkpoint, {optimizer.tag, *dynamic})
    since = f"checkpoint {checkpoint}" if checkpoint else "its initial values"
    if plan is None:
        if log.fallback is None and any(entry.tag == optimizer.tag for entry in log.found):
            logger.error("optimizer %d: the push log holds no point at %s for %s: their rows stay the "
                         "checkpoint's, and the pushes applied since are lost", optimizer.handle, since,
                         ", ".join(optimizer.names))
        log.append_mark(optimizer.tag, checkpoint)  # its rows are the checkpoint's from here
        log.flush()
        return 0
    if not plan:
        return 0
    started = time.monotonic()
    pushes = lookups = 0
    steps: Dict[int, list] = {}
    optimizer.replaying = True
    journals = {tag: rows.journal for tag, rows in dynamic.items()}
    try:
        for rows in dynamic.values():
            rows.journal = None
        for record in log.records(plan):
            if isinstance(record, Lookup):
                dynamic[record.tag].lookup(record.ids, record.step)
                lookups += 1
                continue
            once = (record.pusher, record.step) if record.step >= 0 else None
            optimizer.apply_rows(record.params, record.ids, record.gradients, REPLAY_PEER, once)
            optimizer.replayed_pushes[record.pusher] = optimizer.replayed_pushes.get(record.pusher, 0) + 1
            span = steps.setdefault(record.pusher, [record.step, record.step])
            span[0], span[1] = min(span[0], record.step), max(span[1], record.step)
            pushes += 1
    except Exception as error:  # noqa: BLE001 - part of the log applied: these rows are no process's
        reason = (f"replaying the push log failed after {pushes} pushes and {lookups} lookups of optimizer "
                  f"{optimizer.handle} ({', '.join(optimizer.names)}): {one_line(error)}")
        log.set_aside(reason)  # the process that comes next restores its checkpoint alone
        raise state.fault(reason) from error
    finally:
        optimizer.replaying = False
        for tag, rows in dynamic.items():
            rows.journal = journals[tag]
    log.figures.replayed += pushes + lookups
    lows, highs = [low for low, _ in steps.values()], [high for _, high in steps.values()]
    spans = f"steps {min(lows)}-{max(highs)} of {len(steps)} pusher{'s' if len(steps) != 1 else ''}" if steps else ""
    logger.info("optimizer %d: replayed %d pushes%s from the push log since %s in %.2f s (%s)", optimizer.handle,
                pushes, f" and {lookups} lookups" if lookups else "", since, time.monotonic() - started,
                spans or "no steps")
    return pushes + lookups



