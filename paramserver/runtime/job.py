"""Jobs: what workers run, how its code travels, and what it sees while running.

Owns naming a job (``package.module:function`` or ``path/to/file.py:function``),
checking its config (keyword arguments from JSON) against the function's
signature and annotated types (``check_config``: before the server ships it,
and for what a worker's flags add), packing it as cloudpickle bytes *by
value* (so a worker needs no copy of the job's file, only the packages it
imports) and unpacking it on the worker.  What a running job sees of the
cluster is ``context.JobContext``.
"""

import collections.abc
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import sys
import typing
from typing import Any, Callable, Dict, Tuple

import cloudpickle

from ..control.protocol import pb

#: The job ``ps-server`` ships when given none.
DEFAULT_JOB = "paramserver.jobs.ctr:main"


class JobError(ValueError):
    """A job that cannot be found, packed or unpacked; the message says which and why."""


class JobConfigError(JobError):
    """A config the job would not take; the message names its source (a flag), the key, the type expected and
    the value given."""


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
    check_config(function, config or {}, reference, "--job-config")
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


def check_config(function: Callable, config: Dict[str, Any], name: str, source: str,
                 partial: bool = False) -> None:
    """Refuse ``config`` (the keyword arguments after the job's context) that ``function`` would not take: a key
    it has no parameter for (unless it takes ``**kwargs``), a value that is not of the parameter's annotated
    type (checked where the annotation is a plain type or ``Optional``/``Union``/``List``/``Sequence``/
    ``Dict``/``Mapping``/``Tuple`` of them; other annotations are taken on trust), or, unless ``partial``, a
    parameter without a default that it lacks.  ``source`` names where the config came from in the error."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - unresolvable annotations (forward references...): check names only
        hints = {}
    named = {p.name: p for p in parameters[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in parameters):
        unknown = sorted(set(config) - set(named))
        if unknown:
            raise JobConfigError(f"{source}: job {name!r} takes no argument {', '.join(map(repr, unknown))} (it takes "
                           f"{', '.join(named) or 'none'})")
    for key, value in config.items():
        expected = hints.get(key) if key in named else None
        if expected is not None and not _conforms(value, expected):
            raise JobConfigError(f"{source}: {key!r} of job {name!r} must be {_type_name(expected)}, got "
                           f"{json.dumps(value)}")
    if not partial:
        missing = [key for key, p in named.items() if p.default is p.empty and key not in config]
        if missing:
            raise JobConfigError(f"{source}: job {name!r} needs {', '.join(map(repr, missing))}")


_NUMBERS = {int: (int,), float: (int, float), complex: (int, float, complex)}


def _conforms(value: Any, expected: Any) -> bool:
    """Whether a JSON value fits the annotation ``expected`` (an annotation not understood here: True)."""
    if expected is Any:
        return True
    if expected is type(None) or expected is None:
        return value is None
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin is typing.Union or (origin is not None and type(expected).__name__ == "UnionType"):
        return any(_conforms(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin is None:
        if not isinstance(expected, type):
            return True
        if expected in _NUMBERS:
            return isinstance(value, _NUMBERS[expected]) and not isinstance(value, bool)
        if expected in (str, bool, dict, list):
            return isinstance(value, expected)
        if expected is tuple or expected in (collections.abc.Sequence, collections.abc.Iterable):
            return isinstance(value, list)
        if expected is collections.abc.Mapping:
            return isinstance(value, dict)
        return True  # a class of the job's own: built from the value by the job, not by us
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Iterable,
                  collections.abc.Collection):
        if not isinstance(value, list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args))
        return not args or all(_conforms(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        if not isinstance(value, dict):
            return False
        return len(args) != 2 or all(_conforms(v, args[1]) for v in value.values())
    return True


def _type_name(expected: Any) -> str:
    """``int``, ``Optional[Dict]``...: an annotation as its author wrote it."""
    if isinstance(expected, type) and typing.get_origin(expected) is None:
        return expected.__name__
    return str(expected).replace("typing.", "")


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
