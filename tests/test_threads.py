"""Threads sized to the host: cores from affinity and the cgroup quota, shared by the cluster's processes on the
host (as the coordinator counts them, or Slurm's tasks on the node), followed as they change, overrides from
the environment (all with faked cores and cgroup files: single process)."""

import pytest

from paramserver.runtime.threads import (HOST_PROCESSES_ENV, INTEROP_THREADS_ENV, THREADS_ENV, HostThreads,
                                         cgroup_cpu_limit, choose_threads, host_cores, slurm_tasks_on_node)

SIXTEEN = (16, "CPU affinity")


def test_workers_share_the_cores_and_servers_take_one_intra_op_thread():
    alone = choose_threads("worker", {}, SIXTEEN)
    assert (alone.intra_op, alone.inter_op) == (16, 2)
    crowded = {HOST_PROCESSES_ENV: "13"}  # coordinator + 4 shards + 8 workers
    assert choose_threads("worker", crowded, SIXTEEN).intra_op == 1
    assert choose_threads("worker", {HOST_PROCESSES_ENV: "7"}, SIXTEEN).intra_op == 2
    assert choose_threads("worker", {HOST_PROCESSES_ENV: "7"}, (2, "cgroup CPU quota 2")).intra_op == 1
    for role, inter_op in (("shard", 16), ("coordinator", 1)):  # a shard's inter-op pool applies a push in parts
        choice = choose_threads(role, {}, SIXTEEN)
        assert (choice.intra_op, choice.inter_op) == (1, inter_op)
    assert (choose_threads("shard", crowded, SIXTEEN).inter_op, choose_threads("shard", {HOST_PROCESSES_ENV: "4"},
                                                                               SIXTEEN).inter_op) == (1, 4)
    line = choose_threads("worker", crowded, SIXTEEN).describe("worker")
    assert line == ("1 intra-op and 1 inter-op threads: 16 cores (CPU affinity) shared by 13 processes of this host, "
                    "as a worker")


def test_a_host_has_cores_to_spare_when_they_outnumber_the_clusters_processes_on_it():
    assert choose_threads("worker", {}, SIXTEEN).cores_to_spare  # one process per host
    assert choose_threads("worker", {HOST_PROCESSES_ENV: "13"}, SIXTEEN).cores_to_spare  # 8 workers, 4 shards
    assert not choose_threads("worker", {HOST_PROCESSES_ENV: "16"}, SIXTEEN).cores_to_spare
    assert not choose_threads("worker", {HOST_PROCESSES_ENV: "7"}, (2, "CPU affinity")).cores_to_spare
    # Threads set by the environment change nothing: the processes still share the host's cores.
    assert not choose_threads("worker", {HOST_PROCESSES_ENV: "7", THREADS_ENV: "1"}, (2, "x")).cores_to_spare


def test_the_environment_overrides_and_bad_values_are_named():
    choice = choose_threads("shard", {THREADS_ENV: "3", INTEROP_THREADS_ENV: "2"}, SIXTEEN)
    assert (choice.intra_op, choice.inter_op, choice.overridden) == (3, 2, True)
    assert "as set by the environment" in choice.describe("shard")
    for bad in ("0", "many"):
        with pytest.raises(ValueError, match=f"{HOST_PROCESSES_ENV} must be a positive integer, got '{bad}'"):
            choose_threads("worker", {HOST_PROCESSES_ENV: bad}, SIXTEEN)
    with pytest.raises(ValueError, match="role must be one of"):
        choose_threads("driver", {}, SIXTEEN)


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(v2)) is None
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(v2)) == 1.5
    cores, source = host_cores(str(v2))
    assert cores == 1 and source == "cgroup CPU quota 1.5"
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    assert cgroup_cpu_limit(str(v1)) == 4.0
    assert cgroup_cpu_limit(str(tmp_path / "none")) is None


def test_the_clusters_processes_on_the_host_size_the_threads_and_the_environment_overrides():
    assert choose_threads("worker", {}, SIXTEEN, cluster_processes=5).intra_op == 3
    assert choose_threads("shard", {}, SIXTEEN, cluster_processes=4).inter_op == 4
    assert choose_threads("worker", {HOST_PROCESSES_ENV: "2"}, SIXTEEN, cluster_processes=5).intra_op == 8
    assert choose_threads("worker", {}, SIXTEEN, cluster_processes=0).intra_op == 16  # unknown: alone


@pytest.mark.parametrize("environ, tasks", [
    ({}, None),
    ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
    ({"SLURM_TASKS_PER_NODE": "2(x3),5", "SLURM_NODEID": "3"}, 5),
    ({"SLURM_TASKS_PER_NODE": "2(x3),5", "SLURM_NODEID": "1"}, 2),
    ({"SLURM_TASKS_PER_NODE": "2(x3),5"}, 5),  # no node id: the most any node runs
    ({"SLURM_TASKS_PER_NODE": "garbled"}, None),
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_ON_NODE": "16"}, 4),  # every task may use all 16 cores
    ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_ON_NODE": "64"}, 1),  # each task bound to 16 of its own
])
def test_slurm_tasks_on_a_node_share_its_cores(environ, tasks):
    assert slurm_tasks_on_node(environ, 16) == tasks
    expected = tasks or 1
    assert choose_threads("worker", environ, SIXTEEN).host_processes == expected
    # The cluster's count is taken where it is higher than Slurm's; the environment's over both.
    assert choose_threads("worker", environ, SIXTEEN, cluster_processes=6).host_processes == max(6, expected)
    assert choose_threads("worker", {**environ, HOST_PROCESSES_ENV: "3"}, SIXTEEN).host_processes == 3


def test_a_workers_intra_op_threads_follow_the_host_and_an_override_stays(monkeypatch):
    import torch

    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    threads = HostThreads("worker", "ps-worker", {}, SIXTEEN)
    assert threads.apply(4).intra_op == 4 and set_to == [4]
    threads.follow(5)
    assert (threads.choice.intra_op, threads.choice.inter_op, set_to) == (3, 2, [4, 3])
    threads.follow(0)  # unknown (a heartbeat without news): nothing changes
    threads.follow(5)
    threads.follow(6)  # 16 // 6: 2
    assert set_to == [4, 3, 2]
    fixed = HostThreads("worker", "ps-worker", {THREADS_ENV: "2"}, SIXTEEN)
    fixed.apply(4)
    fixed.follow(8)
    assert fixed.choice.intra_op == 2 and set_to == [4, 3, 2, 2]
    pinned = HostThreads("worker", "ps-worker", {HOST_PROCESSES_ENV: "2"}, SIXTEEN)
    pinned.apply(4)
    pinned.follow(8)
    assert pinned.choice.intra_op == 8 and set_to == [4, 3, 2, 2, 8]
