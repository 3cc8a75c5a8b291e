"""paramserver: a parameter-server framework for PyTorch.

This package root owns only the version and the public entry points;
every subsystem lives in its own subpackage (``paramserver.optim`` for
optimizers, ``paramserver.shards`` for the data plane,
``paramserver.control`` for the gRPC control plane, ``paramserver.runtime``
for the processes that join them, ``paramserver.train`` for the training
loop, ``paramserver.checkpoint`` for checkpoints and exports,
``paramserver.serving`` for loading an export).  Entry points are
imported on first use, so ``import paramserver`` stays cheap.
"""

__version__ = "0.1.0"

__all__ = ["connect", "Cluster", "Trainer", "Table", "Batch", "JobContext", "export", "serving", "string_ids",
           "__version__"]


def __getattr__(name):
    if name == "export":
        from .checkpoint.export import export_checkpoint
        return export_checkpoint
    if name == "serving":
        import importlib
        return importlib.import_module(f"{__name__}.serving")
    if name in ("connect", "Cluster", "JobContext"):
        from . import runtime
        return getattr(runtime, name)
    if name == "string_ids":  # string categorical values as ids, as a Parquet reader hashes them
        from .tables.id_hash import string_ids
        return string_ids
    if name in ("Trainer", "Table", "Batch"):
        from . import train
        return getattr(train, name)
    raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
