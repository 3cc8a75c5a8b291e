"""Metrics of the coordinator: members by role, the generation, members lost, trainer groups gone, checkpoints.

Owns ``ClusterCollector``, which reads the membership table (and the
checkpoint coordinator, when checkpoints are configured) at scrape time, so
the control plane records nothing for metrics: it keeps counts it needs
anyway (``Membership.counts()``).  It never changes the table.
"""

from typing import Any, Iterator, List, Optional, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..control.membership import DEAD, EXITED, LEFT, MembershipCounts
from ..control.protocol import ROLE_NAMES


class _Membership(Protocol):
    def counts(self) -> MembershipCounts: ...

    def trainer_groups_gone(self) -> List[int]: ...


class _Checkpoints(Protocol):
    committed: int

    @property
    def newest(self) -> Optional[Any]: ...  # a ``Checkpoint`` (its ``step`` and manifest's ``created_unix``)


class ClusterCollector(Collector):
    """The coordinator's view of the cluster; ``checkpoints`` is ``None`` when none are configured."""

    def __init__(self, membership: _Membership, checkpoints: Optional[_Checkpoints] = None):
        self._membership = membership
        self._checkpoints = checkpoints

    def collect(self) -> Iterator[Metric]:
        counts = self._membership.counts()
        yield GaugeMetricFamily("paramserver_cluster_generation",
                                "The cluster's generation: one more on every join, leave and loss",
                                value=counts.generation)
        alive = GaugeMetricFamily("paramserver_members_alive", "Live members, by role", labels=["role"])
        joined = CounterMetricFamily("paramserver_members_joined", "Members that joined, by role", labels=["role"])
        ended = CounterMetricFamily("paramserver_members_ended",
                                    "Members that ended, by role and how: left, dead (declared after the heartbeat "
                                    "timeout) or exited (the supervisor saw the process exit)",
                                    labels=["role", "state"])
        for role, name in sorted(ROLE_NAMES.items()):
            alive.add_metric([name], counts.alive.get(role, 0))
            joined.add_metric([name], counts.joined.get(role, 0))
            for state in (LEFT, DEAD, EXITED):
                ended.add_metric([name, state], counts.ended.get((role, state), 0))
        yield alive
        yield joined
        yield ended
        yield GaugeMetricFamily("paramserver_trainer_groups_gone",
                                "Trainer groups left with no live worker for --group-gone-after: other groups take "
                                "over the parts of a followed input they had under way",
                                value=len(self._membership.trainer_groups_gone()))
        yield CounterMetricFamily("paramserver_checkpoints_committed",
                                  "Checkpoints committed (manifest written) by this coordinator",
                                  value=self._checkpoints.committed if self._checkpoints is not None else 0)
        newest = self._checkpoints.newest if self._checkpoints is not None else None
        if newest is not None:  # none yet: absent, not a zero that would read as 1970
            yield GaugeMetricFamily("paramserver_checkpoint_newest_step", "The step of the newest checkpoint",
                                    value=newest.step)
            yield GaugeMetricFamily("paramserver_checkpoint_newest_timestamp_seconds",
                                    "When the newest checkpoint was committed (Unix time; its age: time() - this)",
                                    value=float(newest.manifest.get("created_unix", 0.0)))
