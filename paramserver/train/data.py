"""A worker's position in its data: the batches of the steps ahead, and where to resume after a restore.

Owns ``BatchStream``, the Trainer's reader over any iterable of ``Batch``.
A batch belongs to a step until that step is finished (``finished``): a
step done again after a failure gets the same batch, and a step the group
took from another member instead of training it drops its batch
(``skip``).  Before an agreement the Trainer asks for the batches up to
the next one (``ensure``), so that a worker whose data ends asks its
group to stop there, where every member stops together, instead of
leaving the others waiting in a collective.

Its position (``position()``) goes into checkpoints: the number of
batches used, and, for data with ``state_dict()``/``load_state_dict()``
(the convention of torchdata's ``StatefulDataLoader``), the data's own
state as it was before the first batch not yet used.  A restore loads
that state, or, for other data, skips that many batches.
"""

import collections
import logging
from typing import Any, Deque, Dict, Iterable, Optional, Tuple

from .contract import Batch

logger = logging.getLogger(__name__)


def is_stateful(data) -> bool:
    return callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))


class DataExhausted(RuntimeError):
    """The data ended between two agreements of the group (it cannot stop the group there)."""


class BatchStream:
    """Batches of ``data`` for the steps ahead, from ``position`` (a ``position()`` of an earlier run)."""

    def __init__(self, data: Iterable[Batch], position: Optional[Dict[str, Any]] = None):
        self._data = data
        self._stateful = is_stateful(data)
        restored = position or {}
        self.used = int(restored.get("used", 0))
        loads_state = self._stateful and restored.get("state") is not None
        if loads_state:
            data.load_state_dict(restored["state"])
        self._iterator = iter(data)
        if restored and not loads_state:
            for _ in range(self.used):
                if self._pull() is None:
                    break
            logger.info("data position restored by skipping %d batches", self.used)
        # (batch, the data's state before it was pulled)
        self._ahead: Deque[Tuple[Batch, Any]] = collections.deque()

    def _pull(self) -> Optional[Tuple[Batch, Any]]:
        state = self._data.state_dict() if self._stateful else None
        try:
            return next(self._iterator), state
        except StopIteration:
            return None

    def ensure(self, count: int) -> bool:
        """Read ahead until ``count`` batches are waiting; False when the data ends first."""
        while len(self._ahead) < count:
            pulled = self._pull()
            if pulled is None:
                return False
            self._ahead.append(pulled)
        return True

    def __len__(self) -> int:
        """Batches read ahead, not used yet."""
        return len(self._ahead)

    def current(self) -> Batch:
        """The batch of the step at hand (the same one until ``finished`` or ``skip``)."""
        if not self.ensure(1):
            raise DataExhausted(f"the data ended after {self.used} batches, between two agreements of the group")
        return self._ahead[0][0]

    def finished(self) -> None:
        """The step at hand is done: its batch is used."""
        self._ahead.popleft()
        self.used += 1

    def skip(self, steps: int) -> None:
        """The group moved ``steps`` steps ahead of this member: their batches are dropped unused."""
        for _ in range(steps):
            if not self._ahead and not self.ensure(1):
                return
            self.finished()

    def position(self) -> Dict[str, Any]:
        """Where a restored run resumes: batches used, and the data's state before the next one."""
        if not self._stateful:
            return {"used": self.used, "state": None}
        state = self._ahead[0][1] if self._ahead else self._data.state_dict()
        return {"used": self.used, "state": state}
