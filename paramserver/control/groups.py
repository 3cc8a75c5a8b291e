"""Trainer groups: which workers train together, and when a group re-forms.

Owns the coordinator's policy for trainer groups, pure and in memory (the
membership table calls it under its own lock): assigning each joining
worker to a group, and publishing each group's *views*.  A view is one
generation of a group: its live workers in rank order and the backend
their DDP process group uses.  A new generation is published when the
group's live workers differ from the last view's, once they have stayed
the same for ``settle`` (so workers started together form one group
instead of a chain of growing ones), or at once when the group is full.

Ranks keep their order across generations: survivors first, in their old
order, then newcomers in join order.  So rank 0 of a new view already
trained in the last one whenever anyone did, and can hand its state on.
A group left with no live worker for ``gone_after`` is *gone* (``gone``)
until a worker joins it again: other groups may take over the parts of a
followed input it had under way (``paramserver.train.claims``).  A worker
restarted by its supervisor within that time joins it again (the lowest
group with room), and the parts it had under way stay its own.
It knows nothing of torch or gRPC transport; the workers form the process
groups themselves (``paramserver.ddp.group``).
"""

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .protocol import pb

logger = logging.getLogger(__name__)

#: How long a group's membership must stay unchanged before a view that is
#: not full is published.
GROUP_SETTLE = datetime.timedelta(seconds=2)
#: How long a group may have no live worker before it is gone (a restarted worker rejoins well within it).
GROUP_GONE_AFTER = datetime.timedelta(seconds=60)

GLOO, NCCL = "gloo", "nccl"


@dataclass
class _Group:
    live: Dict[str, int] = field(default_factory=dict)  # RPC name -> GPUs, in join order
    changed_at: float = 0.0
    view: Optional[pb.TrainerGroupView] = None
    regroup: bool = False  # the current view broke: publish the next one even if its members are the same
    emptied_at: Optional[float] = None  # when its last live worker went (None: it has one, or never had)
    said_gone: bool = False  # its being gone was said (``newly_gone``), once each time


class TrainerGroups:
    """Groups of ``group_size`` workers (0: one group of every worker)."""

    def __init__(self, group_size: int = 0, settle: datetime.timedelta = GROUP_SETTLE,
                 gone_after: datetime.timedelta = GROUP_GONE_AFTER):
        if group_size < 0:
            raise ValueError(f"group_size must be 0 (one group) or positive, got {group_size}")
        if settle.total_seconds() < 0:
            raise ValueError(f"settle must not be negative, got {settle}")
        if gone_after.total_seconds() < 0:
            raise ValueError(f"gone_after must not be negative, got {gone_after}")
        self.group_size = group_size
        self.settle = settle
        self.gone_after = gone_after
        self._groups: Dict[int, _Group] = {}

    def assign(self) -> int:
        """The group a new worker joins: the lowest-numbered one with room."""
        if self.group_size == 0:
            return 0
        group = 0
        while len(self._groups.get(group, _Group()).live) >= self.group_size:
            group += 1
        return group

    def add(self, group: int, rpc_name: str, gpus: int, now: float) -> None:
        state = self._groups.setdefault(group, _Group())
        state.live[rpc_name] = gpus
        state.changed_at = now
        state.emptied_at, state.said_gone = None, False

    def remove(self, group: int, rpc_name: str, now: float) -> None:
        state = self._groups.get(group)
        if state is not None and state.live.pop(rpc_name, None) is not None:
            state.changed_at = now
            if not state.live:
                state.emptied_at = now

    def gone(self, now: float) -> List[int]:
        """The groups left with no live worker for ``gone_after`` or longer, by number."""
        return [group for group, state in sorted(self._groups.items())
                if state.emptied_at is not None and now - state.emptied_at >= self.gone_after.total_seconds()]

    def newly_gone(self, now: float) -> List[Tuple[int, float]]:
        """The groups gone (``gone``) that were not said to be since they last had a live worker, with how
        many seconds they have had none: each is said once (the coordinator's sweep logs it)."""
        said = []
        for group in self.gone(now):
            state = self._groups[group]
            if not state.said_gone:
                state.said_gone = True
                said.append((group, now - state.emptied_at))
        return said

    def new_run(self) -> None:
        """The job starts again (no worker is alive): no group of the run before is gone in the new one."""
        for state in self._groups.values():
            state.emptied_at, state.said_gone = None, False

    def regroup(self, group: int, generation: int, now: float) -> None:
        """A member says ``generation`` of ``group`` broke: the next view is due at once, even with the
        same members (asked again for a generation already replaced, it does nothing)."""
        state = self._groups.get(group)
        if state is not None and state.view is not None and state.view.generation == generation:
            state.regroup = True
            state.changed_at = now

    def view(self, group: int, now: float) -> Optional[pb.TrainerGroupView]:
        """The newest view of ``group``, publishing a new generation first when one is due."""
        state = self._groups.get(group)
        if state is None:
            return None
        if self._due(state, now):
            previous = list(state.view.members) if state.view is not None else []
            members = [name for name in previous if name in state.live]
            members += [name for name in state.live if name not in members]
            backend = NCCL if all(state.live[name] > 0 for name in members) else GLOO
            state.view = pb.TrainerGroupView(
                group=group, generation=(state.view.generation if state.view is not None else 0) + 1,
                members=members, backend=backend)
            state.regroup = False
            logger.info("trainer group %d: generation %d formed by %s (%s)", group, state.view.generation,
                        ", ".join(members), backend)
        return state.view

    def _due(self, state: _Group, now: float) -> bool:
        if not state.live:
            return False
        if state.regroup:
            return True
        if state.view is not None and set(state.view.members) == set(state.live):
            return False
        full = self.group_size > 0 and len(state.live) >= self.group_size
        return full or now - state.changed_at >= self.settle.total_seconds()

    def snapshot(self) -> Dict[str, Any]:
        """The groups as plain JSON types, for the coordinator's journal: live workers and the newest view."""
        return {str(group): {"live": dict(state.live),
                             "view": None if state.view is None else
                             {"generation": state.view.generation, "members": list(state.view.members),
                              "backend": state.view.backend}}
                for group, state in self._groups.items()}

    def restore(self, snapshot: Dict[str, Any], now: float) -> None:
        """Take back what ``snapshot`` wrote: the same views, so that re-attaching workers train on in the
        generation they formed (one whose member does not re-attach re-forms as it would have)."""
        for key, saved in snapshot.items():
            state = _Group(live={name: int(gpus) for name, gpus in saved["live"].items()}, changed_at=now)
            if saved["view"] is not None:
                view = saved["view"]
                state.view = pb.TrainerGroupView(group=int(key), generation=int(view["generation"]),
                                                 members=view["members"], backend=view["backend"])
            if not state.live:
                state.emptied_at = now
            self._groups[int(key)] = state

    def views(self, now: float) -> List[pb.TrainerGroupView]:
        """The newest view of every group, by group number."""
        return [view for view in (self.view(group, now) for group in sorted(self._groups)) if view is not None]
