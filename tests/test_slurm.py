"""``deploy/slurm/paramserver.sbatch`` through a real Slurm: slurmctld and slurmd (Debian's ``slurm-wlm``) of a
one-node cluster on loopback, configured and started by the fixture in the test's temporary folder.

Owns the checks that, as a user submits it, the script's own ``#SBATCH`` lines admit two workers on one node the
way its header says (``--ntasks-per-node=2``; ``--ntasks=2`` alone is refused, as the header says), the server
listens on the node's address that other nodes would reach (not loopback), and the job ends with exit 0 once both
workers finished.  Skipped, naming the package, where Slurm is not installed.  (``tests/test_launch.py`` runs the
script with a fake ``srun`` across two "nodes".)
"""

import datetime
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from commands import BIN

ROOT = pathlib.Path(__file__).resolve().parent.parent
SBATCH = ROOT / "deploy" / "slurm" / "paramserver.sbatch"
#: A small job: a few steps of the default job, one shard.
JOB = {"PS_SHARDS": "1", "PS_JOB_CONFIG": '{"steps": 20, "batch_size": 256}'}
READY_WITHIN = datetime.timedelta(seconds=30)

SLURM_CONF = """\
ClusterName=paramserver-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
# One machine: nothing to authenticate between the daemons (no munged to start).
AuthType=auth/none
CredType=cred/none
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
# No cgroups: a job's processes are its process groups.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=sched_interval=1
# Two CPUs whatever this machine has: two tasks of one CPU each fit on the node.
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node_address() -> str:
    """This machine's first IPv4 address outside loopback, as the script finds it ("" where there is none)."""
    found = subprocess.run(["hostname", "--all-ip-addresses"], capture_output=True, text=True).stdout.split()
    return next((a for a in found if re.fullmatch(r"\d+(\.\d+){3}", a) and not a.startswith("127.")), "")


class Slurm:
    """slurmctld and slurmd of one node on loopback, in ``folder``; ``environment`` points Slurm's commands at it."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        for name in ("state", "spool"):
            (folder / name).mkdir(parents=True)
        host = socket.gethostname().split(".")[0]  # slurmctld runs only where SlurmctldHost names this host
        conf = folder / "slurm.conf"
        conf.write_text(SLURM_CONF.format(host=host, ctld_port=free_port(), d_port=free_port(), folder=folder))
        self.environment = {"SLURM_CONF": str(conf)}
        self.daemons = []
        try:
            for command in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", host]):
                with open(folder / f"{command[0]}.out", "w") as out:
                    self.daemons.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                                         env=self.env(), start_new_session=True))
        except BaseException:
            self.stop()
            raise

    def env(self, **more: str) -> dict:
        return dict(os.environ, **self.environment, **more)

    def run(self, *command: str, **more: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, env=self.env(**more), timeout=300)

    def wait_until_idle(self) -> None:
        deadline = time.monotonic() + READY_WITHIN.total_seconds()
        while self.run("sinfo", "--noheader", "--format=%t").stdout.strip() != "idle":
            if time.monotonic() > deadline or any(daemon.poll() is not None for daemon in self.daemons):
                logs = "".join((self.folder / f"{name}.out").read_text()[-2000:] for name in ("slurmctld", "slurmd"))
                raise AssertionError(f"the node was not idle within {READY_WITHIN}:\n{logs}")
            time.sleep(0.2)

    def wait_for_job(self, job_id: str, timeout: datetime.timedelta) -> str:
        """The job's exit code (``scontrol``'s ``ExitCode=``, e.g. ``0:0``) once it ended: polled twice a second
        (``sbatch --wait`` polls every few seconds, up to ten)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            shown = self.run("scontrol", "--oneliner", "show", "job", job_id).stdout
            state = re.search(r"JobState=(\S+)", shown)
            if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return re.search(r" ExitCode=(\S+)", shown).group(1)
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not end within {timeout}")

    def stop(self) -> None:
        """Cancel what is left of the jobs, then end slurmd and slurmctld by their pids (SIGKILL after 10 s)."""
        if self.daemons and self.daemons[0].poll() is None:
            self.run("scancel", "--full", "--partition=test")
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()


@pytest.fixture
def slurm(tmp_path):
    missing = [name for name in ("slurmctld", "slurmd", "sbatch", "srun") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)}: Slurm is Debian's slurm-wlm package (apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as root here: the test needs root")
    cluster = Slurm(tmp_path / "slurm")
    try:
        cluster.wait_until_idle()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
def test_the_sbatch_script_runs_two_workers_on_one_node_of_a_real_slurm(slurm, tmp_path):
    address = node_address()
    if not address:
        pytest.skip("this machine has no IPv4 address but loopback, and the script never serves on loopback")
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "PS_PORT": str(free_port()), **JOB}

    refused = slurm.run("sbatch", "--nodes=1", "--ntasks=2", str(SBATCH), **env)
    assert refused.returncode != 0 and "Requested node configuration is not available" in refused.stderr, \
        refused.stderr

    log = tmp_path / "job.out"
    submitted = slurm.run("sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
                          f"--output={log}", str(SBATCH), **env)
    assert submitted.returncode == 0, submitted.stderr
    code = slurm.wait_for_job(submitted.stdout.strip(), datetime.timedelta(seconds=200))
    logs = log.read_text() if log.exists() else ""
    assert code == "0:0", logs[-4000:]
    assert f" at {address}:{env['PS_PORT']} (1 shards), 2 workers" in logs, logs[-4000:]
    for worker in ("worker0", "worker1"):
        assert f"{worker} finished paramserver.jobs.ctr:main at step 20" in logs, logs[-4000:]
    assert "ps-server ended with exit code 0" in logs, logs[-4000:]
