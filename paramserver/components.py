"""torchx components: a paramserver cluster as one torchx ``AppDef``, launched on any torchx scheduler.

    torchx run -s local_cwd paramserver.components.ps_job --shards 2 --workers 1 --job_config '{"steps": 20}'
    torchx run -s kubernetes paramserver.components.ps_job --image registry.example.com/paramserver:0.1.0
    torchx run -s slurm paramserver.components.ps_job --shards 4 --workers 8

Owns turning the component's arguments into two roles: ``server`` (one
replica: ``ps-server``, the coordinator and its shards, which shuts itself
down once every worker has left) and ``worker`` (``ps-worker`` replicas that
connect to the server's host).  The server is role 0, so torchx's
``rank0_env`` names its host on every scheduler (``TORCHX_RANK0_HOST`` on
local_cwd, Volcano's ``VC_SERVER_0_HOSTS`` on Kubernetes,
``SLURM_JOB_NODELIST_HET_GROUP_0`` on Slurm); the server listens on its own
host's address (``hostname -i``).  Secrets travel as files only: token paths
on a mount (``mounts``, ``server_mounts``), never a token in an argument or the
environment.  Nothing here runs a process; docs/deployment.md shows the runs.

Needs the ``torchx`` extra (``pip install 'paramserver[torchx]'``); without it,
importing this module fails with an error that says so.
"""

import shlex
from typing import Dict, List, Optional

try:
    import torchx.specs as specs
except ModuleNotFoundError as error:  # one line naming the extra, not torchx's own traceback
    raise ModuleNotFoundError("paramserver.components needs torchx: pip install 'paramserver[torchx]'",
                              name=error.name) from error

from .cli.common import UsageError, job_config_from
from .control import DEFAULT_PORT
from .runtime.job import DEFAULT_JOB

#: The image the Kubernetes manifests in deploy/k8s run (deploy/Dockerfile); local_cwd and Slurm ignore it.
DEFAULT_IMAGE = "paramserver:0.1.0"
#: The roles, in order: the server first, so that torchx's rank0 host is the server's.
SERVER_ROLE, WORKER_ROLE = "server", "worker"
#: How long a worker retries a coordinator that is not up yet (its pod or node may start first).
WORKER_RETRY_FOR_SECONDS = 300
#: Stands for torchx's macro ``rank0_env`` (the name of the variable holding the server's host) in a script.
RANK0_ENV = "PARAMSERVER_RANK0_ENV"
#: Shell: this host's first IPv4 address, the one the server listens on (a pod's IP, a node's address).
OWN_ADDRESS = "$(hostname -i | tr ' ' '\\n' | grep -m1 -E '^[0-9.]+$')"


def ps_job(shards: int = 4, workers: int = 2, job: str = DEFAULT_JOB, job_config: str = "{}",
           group_size: int = 0, hook: Optional[str] = None, port: int = DEFAULT_PORT,
           image: str = DEFAULT_IMAGE, token_file: Optional[str] = None, shard_token_file: Optional[str] = None,
           mounts: Optional[List[str]] = None, server_mounts: Optional[List[str]] = None,
           worker_retries: int = 3, server_cpu: int = 4, server_memMB: int = 16384, worker_cpu: int = 2,
           worker_memMB: int = 4096, log_level: str = "INFO") -> specs.AppDef:
    """A paramserver cluster: one ps-server (coordinator and shards), then ps-workers that run its job.

    The server shuts down once every worker has left, so the app ends when the job does.

    Args:
        shards: shard server processes in the server's replica
        workers: ps-worker replicas
        job: what workers run, package.module:function or file.py:function (in the image)
        job_config: the job's keyword arguments, a JSON object
        group_size: workers per trainer group (0: every worker in one group)
        hook: the DDP comm hook of the workers' trainer group (default: the job's)
        port: the coordinator's gRPC port
        image: the container image (Kubernetes); local_cwd and Slurm run the installed commands
        token_file: path of the cluster token file, on a mount every role has
        shard_token_file: path of the shard token file, on a mount only the server has (server_mounts)
        mounts: mounts of every role, torchx syntax: type=volume,src=PVC,dst=/etc/paramserver,readonly
        server_mounts: mounts of the server only (the shard token's)
        worker_retries: times a failed worker is replaced alone (the server is never restarted)
        server_cpu: CPUs of the server's replica
        server_memMB: memory of the server's replica, MB (0.5 GiB a process plus the tables)
        worker_cpu: CPUs of a worker
        worker_memMB: memory of a worker, MB
        log_level: DEBUG, INFO, WARNING or ERROR
    """
    _check(shards=shards, workers=workers, job_config=job_config, group_size=group_size, port=port,
           worker_retries=worker_retries, token_file=token_file, shard_token_file=shard_token_file)
    tokens = ["--token-file", token_file] if token_file else []
    server = ["ps-server", "--host", _NoQuote(f'"{OWN_ADDRESS}"'), "--port", str(port), "--shards", str(shards),
              "--job", job, "--job-config", job_config, "--group-size", str(group_size),
              "--stop-after-workers", str(workers), *tokens,
              *(["--shard-token-file", shard_token_file] if shard_token_file else []), "--log-level", log_level]
    # On local_cwd every role runs here and rank0 is "localhost": connect to this host's address, where the
    # server listens, instead.
    find_server = (f'server="${{{RANK0_ENV}:-localhost}}"; '
                   f'if [ "$server" = localhost ]; then server="{OWN_ADDRESS}"; fi; ')
    worker = ["ps-worker", "--connect", _NoQuote(f'"$server:{port}"'), "--retry-for", str(WORKER_RETRY_FOR_SECONDS),
              *tokens, *(["--comm-hook", hook] if hook else []), "--log-level", log_level]
    common = specs.parse_mounts(mounts) if mounts else []
    return specs.AppDef(name="paramserver", roles=[
        specs.Role(name=SERVER_ROLE, image=image, entrypoint="bash", args=["-c", _script("exec " + _shell(server))],
                   num_replicas=1, resource=specs.resource(cpu=server_cpu, memMB=server_memMB),
                   port_map={"grpc": port}, env=_env(),
                   # A new coordinator would be a new cluster (its tables start over): never restarted.
                   max_retries=0, retry_policy=specs.RetryPolicy.APPLICATION,
                   mounts=common + (specs.parse_mounts(server_mounts) if server_mounts else [])),
        specs.Role(name=WORKER_ROLE, image=image, entrypoint="bash",
                   args=["-c", _script(find_server + "exec " + _shell(worker))], num_replicas=workers,
                   resource=specs.resource(cpu=worker_cpu, memMB=worker_memMB), env=_env(),
                   # A failed worker is replaced alone; it joins the running cluster as a new member.
                   max_retries=worker_retries, retry_policy=specs.RetryPolicy.REPLICA, mounts=common),
    ])


class _NoQuote(str):
    """An argument the role's shell expands (``$server``, ``$(hostname -i)``): written as is, not quoted."""


def _shell(words: List[str]) -> str:
    """One shell command line of ``words``, each quoted unless it is a ``_NoQuote``."""
    return " ".join(word if isinstance(word, _NoQuote) else shlex.quote(word) for word in words)


def _script(text: str) -> str:
    """A role's ``bash -c`` script as torchx takes it: every ``$`` doubled (torchx substitutes its macros in
    arguments, ``$$`` giving ``$``), then ``RANK0_ENV`` made the macro naming the variable of rank0's host."""
    return text.replace("$", "$$").replace(RANK0_ENV, specs.macros.rank0_env)


def _env() -> Dict[str, str]:
    return {"PYTHONUNBUFFERED": "1"}


def _check(shards: int, workers: int, job_config: str, group_size: int, port: int, worker_retries: int,
           token_file: Optional[str], shard_token_file: Optional[str]) -> None:
    """Bad arguments refused before anything is launched, each in one line naming the argument."""
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if group_size < 0:
        raise ValueError(f"--group_size must be 0 (one group of every worker) or positive, got {group_size}")
    if not 0 < port < 65536:
        raise ValueError(f"--port must be 1-65535, got {port}")
    if worker_retries < 0:
        raise ValueError(f"--worker_retries must be 0 or more, got {worker_retries}")
    try:
        job_config_from(job_config)  # ps-server's own check of the same text
    except UsageError as error:
        raise ValueError(str(error)) from None
    if shard_token_file and not token_file:
        raise ValueError("--shard_token_file needs --token_file (a cluster without a token admits any shard)")
