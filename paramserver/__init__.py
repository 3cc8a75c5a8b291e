"""paramserver: a parameter-server framework for PyTorch.

This package root owns only the version and the public re-exports; every
subsystem lives in its own subpackage (``paramserver.optim`` for the
optimizers that shard servers run).
"""

__version__ = "0.1.0"
