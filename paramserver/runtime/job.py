"""Jobs: what workers run, how its code travels, and what it sees while running.

Owns naming a job (``package.module:function`` or ``path/to/file.py:function``),
packing it as cloudpickle bytes *by value* (so a worker needs no copy of the
job's file, only the packages it imports) and unpacking it on the worker.
What a running job sees of the cluster is ``context.JobContext``.
"""

import importlib
import importlib.util
import json
import os
import pathlib
import sys
from typing import Any, Callable, Dict, Tuple

import cloudpickle

from ..control.protocol import pb

#: The job ``ps-server`` ships when given none.
DEFAULT_JOB = "paramserver.jobs.ctr:main"


class JobError(ValueError):
    """A job that cannot be found, packed or unpacked; the message says which and why."""


def load_job(reference: str) -> Callable:
    """The callable named by ``reference``: ``module:function`` (installed, or under the current directory)
    or ``file.py:function``."""
    module_part, sep, function_name = reference.rpartition(":")
    if not sep or not module_part or not function_name:
        raise JobError(f"job {reference!r} must look like package.module:function or path/to/file.py:function")
    if module_part.endswith(".py"):
        path = pathlib.Path(module_part)
        if not path.is_file():
            raise JobError(f"job file {path} does not exist")
        module_name = f"paramserver_job_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise JobError(f"job file {path} failed to load: {type(error).__name__}: {error}") from error
    else:
        # As ``python -m`` does: a checkout's own jobs (``workers.X:main`` run from its root) are found from
        # the current directory, after everything installed.
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ImportError as error:
            raise JobError(f"job module {module_part!r} cannot be imported: {error}") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise JobError(f"job {reference!r}: {module_part} has no callable named {function_name!r}")
    return function


def pack_job(reference: str, config: Dict[str, Any] = None, group_size: int = 0) -> pb.JobSpec:
    """Load the job and pickle it by value, with ``config`` (JSON-able keyword arguments).

    ``group_size``: workers per trainer group (0: one group of every worker).
    """
    if group_size < 0:
        raise JobError(f"group_size must be 0 (one group of every worker) or positive, got {group_size}")
    function = load_job(reference)
    module = sys.modules[function.__module__]
    cloudpickle.register_pickle_by_value(module)
    try:
        code = cloudpickle.dumps(function)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    try:
        config_json = json.dumps(config or {})
    except TypeError as error:
        raise JobError(f"job config must be JSON: {error}") from error
    return pb.JobSpec(name=reference, code=code, config_json=config_json, group_size=group_size)


def unpack_job(spec: pb.JobSpec) -> Tuple[Callable, Dict[str, Any]]:
    """The callable and its keyword arguments, from a job spec received from the coordinator."""
    try:
        function = cloudpickle.loads(spec.code)
    except Exception as error:
        raise JobError(f"job {spec.name!r} cannot be unpickled here ({type(error).__name__}: {error}); "
                       "are its imports installed on this worker?") from error
    try:
        config = json.loads(spec.config_json or "{}")
    except json.JSONDecodeError as error:
        raise JobError(f"job {spec.name!r} has a config that is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise JobError(f"job {spec.name!r}: config must be a JSON object, got {type(config).__name__}")
    return function, config
