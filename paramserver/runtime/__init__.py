"""Where the control plane and the data plane meet: the processes of a cluster.

Owns what each role does with its assignment: a shard server process
(joins the coordinator, then serves parameters over torch RPC), the
supervisor that starts and watches shard processes for ``ps-server``, a
worker (joins, runs the shipped job, heartbeats, leaves), and the
``Cluster`` handle behind ``paramserver.connect``.  Jobs are plain Python
callables shipped as cloudpickle bytes (``job``).  Names are imported on
first use, so a command that needs only ``logs`` does not load torch.
"""

__all__ = ["Cluster", "connect", "JobContext", "load_job", "pack_job", "unpack_job"]


def __getattr__(name):
    if name in ("Cluster", "connect"):
        from . import cluster
        return getattr(cluster, name)
    if name == "JobContext":
        from . import context
        return context.JobContext
    if name in ("load_job", "pack_job", "unpack_job"):
        from . import job
        return getattr(job, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
