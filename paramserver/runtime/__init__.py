"""Where the control plane and the data plane meet: the processes of a cluster.

Owns what each role does with its assignment: a shard server process
(joins the coordinator, then serves parameters over torch RPC), the
supervisor that starts and watches shard processes for ``ps-server``, a
worker (joins, runs the shipped job, heartbeats, leaves), and the
``Cluster`` handle behind ``paramserver.connect``.  Jobs are plain Python
callables shipped as cloudpickle bytes (``job``).
"""

from .cluster import Cluster, connect
from .job import JobContext, load_job, pack_job, unpack_job

__all__ = ["Cluster", "connect", "JobContext", "load_job", "pack_job", "unpack_job"]
