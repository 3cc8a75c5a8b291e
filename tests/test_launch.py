"""Launching a cluster through torchx (``paramserver.components.ps_job``) and Slurm (``deploy/slurm/``).

Owns the checks that:

* torchx finds the component by its dotted name, next to its own builtins;
* the Kubernetes and Slurm requests torchx renders from it (its dry run) start the same two
  processes: ps-server on its host's address with ``--stop-after-workers``, ps-workers connecting
  to the scheduler's rank0 host; the ports agree, tokens travel as file paths on mounts (the shard
  token on the server's only) and never as values, and the server is never restarted while a failed
  worker is, alone.  The roles' shell scripts are run with the scheduler's variables set and fake
  ``ps-server``/``ps-worker`` that print what they were given;
* ``torchx run -s local_cwd`` trains on this machine and ends with exit 0;
* ``deploy/slurm/paramserver.sbatch`` runs with the Slurm variables set by hand and fake ``srun``
  and ``scontrol`` (two "nodes": each srun task in a process group of its own, on loopback, the
  address given as PS_ADDRESS), and ends with exit 0 (``tests/test_slurm.py`` runs it through a real
  Slurm).
"""

import argparse
import importlib
import json
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys

import pytest

from commands import BIN, errors, output
from paramserver.cli import server as server_cli
from paramserver.cli import worker as worker_cli
from paramserver.runtime.job import DEFAULT_JOB

specs = pytest.importorskip("torchx.specs", reason="the torchx extra (pip install 'paramserver[torchx]')")
from torchx.runner import get_runner  # noqa: E402 - after the skip above
from torchx.specs.finder import get_component  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
SBATCH = ROOT / "deploy" / "slurm" / "paramserver.sbatch"
COMPONENT = "paramserver.components.ps_job"
SECRET = "s3cret-token-value-never-in-a-spec"
#: A small job: a few steps of the default job.
SMALL_JOB = json.dumps({"steps": 20, "batch_size": 256})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def dryrun(scheduler: str, *args: str, **cfg):
    """torchx's dry run of the component: the request it would submit (no cluster is reached)."""
    return get_runner().dryrun_component(COMPONENT, list(args), scheduler, cfg=cfg, workspace=None).request


def fake_commands(folder: pathlib.Path) -> dict:
    """``ps-server`` and ``ps-worker`` that print their arguments as JSON; the environment to find them."""
    folder.mkdir()
    for name in ("ps-server", "ps-worker"):
        path = folder / name
        path.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def run_script(command: list, env: dict) -> list:
    """A role's command (``bash -c SCRIPT``) run here; the arguments its fake ps-* command got."""
    done = subprocess.run(command, env=dict(os.environ, **env), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def parsed(module, args: list):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(args)


def test_torchx_finds_the_component_next_to_its_builtins():
    component = get_component(COMPONENT)
    assert component.validation_errors == []
    assert get_component("dist.ddp").validation_errors == []  # registering ours keeps torchx's own


@pytest.mark.parametrize("bad, says", [({"shards": 0}, "--shards"), ({"workers": 0}, "--workers"),
                                       ({"port": 0}, "--port"), ({"job_config": "[1]"}, "--job.config"),
                                       ({"job_config": "{steps"}, "--job.config"),
                                       ({"shard_token_file": "/s"}, "--token_file")])
def test_bad_arguments_are_refused_in_one_line_naming_them(bad, says):
    from paramserver.components import ps_job
    with pytest.raises(ValueError, match=says) as refused:
        ps_job(**bad)
    assert "\n" not in str(refused.value)


# torchx notes on every run with worker retries that Volcano 1.4 retried wrongly.
@pytest.mark.filterwarnings("ignore::UserWarning:torchx.schedulers.kubernetes_scheduler")
def test_the_kubernetes_request_starts_the_server_then_workers_that_reach_it(tmp_path):
    token = tmp_path / "token"
    token.write_text(SECRET)
    port = 50099
    job = dryrun("kubernetes", "--shards", "3", "--workers", "2", "--port", str(port), "--job_config", SMALL_JOB,
                 "--token_file", "/etc/paramserver/token/token",
                 "--shard_token_file", "/etc/paramserver/shard-token/token",
                 "--mounts", "type=volume,src=ps-token,dst=/etc/paramserver/token,readonly",
                 "--server_mounts", "type=volume,src=ps-shard-token,dst=/etc/paramserver/shard-token,readonly",
                 queue="default")
    assert SECRET not in str(job)
    resource = job.resource
    tasks = resource["spec"]["tasks"]
    assert [task["name"] for task in tasks] == ["server-0", "worker-0", "worker-1"]
    # Restarts: never the server (nor the whole job); a failed worker alone, up to worker_retries times.
    assert resource["spec"]["maxRetry"] == 0 and "maxRetry" not in tasks[0]
    assert all(task["maxRetry"] == 3 and task["policies"] == [] for task in tasks[1:])
    pods = [task["template"] for task in tasks]
    for pod in pods:
        assert pod.spec.restart_policy == "Never"
    server, *workers = [pod.spec.containers[0] for pod in pods]
    assert [p.container_port for p in server.ports] == [port]
    # Secrets as files on mounts: the shard token's on the server only.
    mounted = [{m.mount_path for m in container.volume_mounts} for container in (server, *workers)]
    assert {"/etc/paramserver/token", "/etc/paramserver/shard-token"} <= mounted[0]
    assert all("/etc/paramserver/token" in m and "/etc/paramserver/shard-token" not in m for m in mounted[1:])

    env = fake_commands(tmp_path / "bin")
    args = parsed(server_cli, run_script(server.command, env))
    assert (args.port, args.shards, args.stop_after_workers, args.job) == (port, 3, 2, DEFAULT_JOB)
    assert json.loads(args.job_config) == json.loads(SMALL_JOB)
    assert socket.inet_aton(args.host)  # this host's address (a pod's IP), not a name
    assert (args.token_file, args.shard_token_file) == ("/etc/paramserver/token/token",
                                                        "/etc/paramserver/shard-token/token")
    # Volcano's svc plugin names task server-0's host in VC_SERVER_0_HOSTS, in every pod of the job.
    host = "paramserver-x-server-0-0.paramserver-x"
    for worker in workers:
        args = parsed(worker_cli, run_script(worker.command, dict(env, VC_SERVER_0_HOSTS=host)))
        assert args.connect == f"{host}:{port}"
        assert args.token_file == "/etc/paramserver/token/token"


def test_the_slurm_request_is_one_heterogeneous_job_whose_workers_reach_the_first_group(tmp_path):
    request = dryrun("slurm", "--shards", "2", "--workers", "2", "--token_file", "/shared/ps/token",
                     "--hook", "allreduce")
    script = request.materialize()
    assert script.count("#SBATCH hetjob") == 2  # three groups: server-0, worker-0, worker-1
    assert "TORCHX_MAX_RETRIES=0" in script  # the server is never restarted, so nor is the job
    assert list(request.replicas) == ["server-0", "worker-0", "worker-1"]
    env = fake_commands(tmp_path / "bin")
    server = request.replicas["server-0"]
    args = parsed(server_cli, run_script([server.entrypoint, *server.args], env))
    assert (args.port, args.shards, args.stop_after_workers, args.token_file) == (50051, 2, 2, "/shared/ps/token")
    for name in ("worker-0", "worker-1"):
        worker = request.replicas[name]
        args = parsed(worker_cli, run_script([worker.entrypoint, *worker.args],
                                             dict(env, SLURM_JOB_NODELIST_HET_GROUP_0="node7")))
        assert (args.connect, args.comm_hook, args.token_file) == ("node7:50051", "allreduce", "/shared/ps/token")


@pytest.mark.timeout(240)
def test_torchx_local_cwd_trains_on_this_machine(commands, tmp_path):
    env = {"PATH": f"{BIN}:{os.environ['PATH']}"}  # the roles run ps-server and ps-worker from PATH
    run = commands.start("torchx", "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}", COMPONENT,
                         "--shards", "1", "--workers", "1", "--port", str(free_port()), "--job_config", SMALL_JOB,
                         env=env)
    try:
        code = run.wait(200)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)  # torchx's local scheduler then ends its replicas
            run.wait(30)
    logs = output(run) + errors(run)
    assert code == 0, logs[-4000:]
    assert "finished paramserver.jobs.ctr:main at step 20" in logs
    assert "shutting down: 1 worker left and none is running" in logs
    assert "Job finished: SUCCEEDED" in logs


FAKE_SRUN = '''#!PYTHON
"""srun on one machine: each task of a step in a process group of its own ("a node"); signals passed on."""
import os, signal, subprocess, sys
args = sys.argv[1:]
options = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    options[key] = value
tasks = int(options.get("ntasks", "1"))
children = [subprocess.Popen(args, start_new_session=True, env=dict(os.environ, SLURM_PROCID=str(rank)))
            for rank in range(tasks)]
with open(os.environ["FAKE_SLURM_PIDS"], "a") as pids:
    pids.write("".join(f"{child.pid}\\n" for child in children))
def forward(signum, _frame):
    for child in children:
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
sys.exit(max(child.wait() for child in children))
'''

FAKE_SCONTROL = '''#!/bin/bash
# scontrol show hostnames node[1-2] -> node1 and node2, a line each
[ "$1 $2" = "show hostnames" ] || exit 1
prefix=${3%%[*}; range=${3#*[}; range=${range%]}
seq -f "$prefix%g" "${range%-*}" "${range#*-}"
'''


@pytest.mark.timeout(240)
def test_the_sbatch_script_runs_a_server_and_workers_across_the_allocation(commands, tmp_path):
    fake = tmp_path / "slurm-bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN.replace("PYTHON", sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    pids = tmp_path / "pids"
    pids.touch()
    env = {"PATH": f"{fake}:{BIN}:{os.environ['PATH']}", "FAKE_SLURM_PIDS": str(pids),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NTASKS": "1", "PS_SHARDS": "1", "PS_PORT": str(free_port()), "PS_JOB_CONFIG": SMALL_JOB,
           "PS_ADDRESS": "127.0.0.1"}  # the "nodes" are this machine's process groups: loopback, given
    job = commands.start(str(SBATCH), env=env)
    try:
        code = job.wait(200)
    finally:
        for pid in map(int, pids.read_text().split()):  # every task the fake srun started, by its group
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    logs = output(job) + errors(job)
    assert code == 0, logs[-4000:]
    assert len(pids.read_text().split()) == 2  # the server, one worker: no address probe, PS_ADDRESS is given
    assert "finished paramserver.jobs.ctr:main at step 20" in logs
    assert "ps-server ended with exit code 0" in logs
    assert "ps-server on node1 at 127.0.0.1:" in logs


def test_without_torchx_the_component_module_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchx", None)  # as if torchx were not installed
    monkeypatch.delitem(sys.modules, "paramserver.components", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'paramserver\[torchx\]'"):
        importlib.import_module("paramserver.components")


@pytest.mark.parametrize("flags, says", [(["--stop-after-workers", "-1"], "--stop-after-workers must be 0"),
                                         (["--join", "127.0.0.1:1", "--stop-after-workers", "2"],
                                          "--stop-after-workers belongs on the coordinator")])
def test_ps_server_refuses_a_bad_stop_after_workers(flags, says):
    args = parsed(server_cli, flags)
    with pytest.raises(server_cli.UsageError, match=says):
        server_cli.shard_host_options_from(args) if args.join else server_cli.options_from(args)
