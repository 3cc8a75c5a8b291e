"""The commands' argument handling, in process: every bad flag is refused naming
the flag, and status renders as the JSON object and the table users read."""

import argparse
import datetime
import json
import re
from typing import List, Optional, Tuple

import pytest

from paramserver.cli import ctl, demo, server, worker
from paramserver.cli.common import UsageError, coordinator_address, data_plane_host
from paramserver.control.protocol import pb
from paramserver.runtime.job import JobConfigError, check_config


@pytest.mark.parametrize("value, expected", [
    ("10.0.0.1:6000", "10.0.0.1:6000"), ("node-1", "node-1:50051"), ("[::1]:7000", "[::1]:7000"),
    ("[::1]", "[::1]:50051"),
])
def test_coordinator_addresses(value, expected):
    assert coordinator_address(value) == expected


@pytest.mark.parametrize("value", ["", "host:", ":80", "host:http", "host:70000"])
def test_bad_coordinator_addresses_are_refused(value):
    with pytest.raises(UsageError, match="--connect"):
        coordinator_address(value)


def test_data_plane_host_refuses_wildcards_and_ipv6():
    assert data_plane_host("--host", "10.1.2.3") == "10.1.2.3"
    for value in ("0.0.0.0", "::1", "::"):
        with pytest.raises(UsageError, match="--host"):
            data_plane_host("--host", value)


def server_args(*argv):
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--shards", "-1"], "--shards must be 0"),
    (["--shard-prefix", "shard-a"], "--shard-prefix 'shard-a': a letter, then"),
    (["--tls-ca", "ca.pem"], "--tls-ca is for --join"),
    (["--port", "70000"], "--port must be 0-65535"),
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--job-config", "{oops"], "--job-config is not JSON"),
    (["--job-config", "[1]"], "--job-config must be a JSON object"),
    (["--job", "no_such_module:main"], "--job: job module 'no_such_module' cannot be imported"),
    (["--job", "workers.regression"], "must look like package.module:function"),
    (["--heartbeat-timeout", "0.5"], "--heartbeat-timeout must exceed"),
    (["--group-size", "-1"], "--group-size must be 0"),
    (["--group-settle", "-1"], "--group-settle must not be negative"),
    (["--host", "0.0.0.0"], "not a wildcard"),
    (["--export-every", "10"], "--export-every, --export-base-every and --keep-exports need --export-dir"),
    (["--keep-exports", "2"], "--export-every, --export-base-every and --keep-exports need --export-dir"),
    (["--export-dir", "live", "--keep-exports", "0"], "--keep-exports must be at least 1, got 0"),
    (["--export-dir", "live", "--export-every", "0"], "--export-every must be at least 1, got 0"),
    (["--export-dir", "oci://bucket/live"], "--export-dir: oci://bucket/live: the oci:// protocol needs a package"),
    (["--checkpoint-dir", "/proc/forbidden"], "--checkpoint-dir /proc/forbidden: cannot write there"),
    (["--job-config", '{"steps": "many"}'], "--job-config: 'steps' of job 'paramserver.jobs.ctr:main' must be int, got \"many\""),
    (["--job-config", '{"stepz": 5}'], "--job-config: job 'paramserver.jobs.ctr:main' takes no argument 'stepz'"),
    (["--row-store", "/no/such/folder"], "--row-store /no/such/folder: no such directory"),
    (["--row-memory", "4G"], "--row-memory needs --row-store"),
    (["--row-store-engine", "log"], "--row-store-engine needs --row-store"),
    (["--row-store", "/tmp", "--row-memory", "lots"], "--row-memory 'lots': a size such as 512M or 4G"),
    (["--row-store", "/tmp", "--row-store-engine", "tape"], "--row-store-engine must be one of"),
])
def test_server_flags_are_checked(argv, message):
    with pytest.raises(UsageError, match=message):
        server.options_from(server_args(*argv))


def test_row_store_flags_reach_the_shards_of_a_coordinator_and_of_a_shard_host(tmp_path):
    from paramserver.shards.server.row_store.stores import RowStoreOptions
    flags = ("--row-store", str(tmp_path), "--row-memory", "512M")
    assert server.options_from(server_args(*flags)).row_store == RowStoreOptions(str(tmp_path), "log", 512 << 20)
    joined = server.shard_host_options_from(server_args("--join", "127.0.0.1:5000", *flags, "--row-store-engine",
                                                        "rocksdb"))
    assert joined.row_store == RowStoreOptions(str(tmp_path), "rocksdb", 512 << 20)
    assert server.options_from(server_args()).row_store is None


@pytest.mark.parametrize("argv, message", [
    (["--port", "5000"], "--join runs no coordinator: --port belongs on the coordinator's ps-server"),
    (["--job-config", "{}", "--checkpoint-dir", "d", "--group-size", "2"],
     "--group-size, --checkpoint-dir belong on"),
    (["--shards", "0"], "--shards must be at least 1"),
    (["--shard-prefix", "a.b"], "--shard-prefix 'a.b'"),
    (["--host", "0.0.0.0"], "not a wildcard"),
])
def test_join_flags_are_checked(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        server.shard_host_options_from(server_args("--join", "127.0.0.1:5000", *argv))


def test_a_joining_server_names_its_shards_after_the_address_facing_the_coordinator():
    options = server.shard_host_options_from(server_args("--join", "127.0.0.1:5000", "--shards", "3"))
    assert (options.coordinator, options.host, options.prefix, options.num_shards) == (
        "127.0.0.1:5000", "127.0.0.1", "shard_127_0_0_1_", 3)
    named = server.shard_host_options_from(server_args("--join", "127.0.0.1", "--shard-prefix", "rack7_"))
    assert (named.coordinator, named.prefix) == ("127.0.0.1:50051", "rack7_")


def secret_files(folder, **secrets):
    """``--token-file``-style files holding ``secrets`` (name -> token); returns name -> path."""
    paths = {}
    for name, secret in secrets.items():
        paths[name] = folder / name
        paths[name].write_text(secret + "\n")
    return {name: str(path) for name, path in paths.items()}


def test_shards_get_a_token_of_their_own_on_both_ps_servers(tmp_path):
    files = secret_files(tmp_path, token="cluster-token", shard="shard-token", same="cluster-token")
    coordinator = server.options_from(server_args("--token-file", files["token"], "--shard-token-file", files["shard"]))
    credential = coordinator.coordinator.shard_credential
    assert (credential.secret, credential.made_for_this_run) == ("shard-token", False)
    # Without a shard token file the server makes one up when it starts (CoordinatorServer), not the flags.
    assert server.options_from(server_args("--token-file", files["token"])).coordinator.shard_credential is None
    joining = server.shard_host_options_from(server_args("--join", "127.0.0.1:5000", "--token-file", files["token"],
                                                         "--shard-token-file", files["shard"]))
    assert (joining.token, joining.shard_token) == ("cluster-token", "shard-token")
    for argv, message in [
        (["--token-file", files["token"], "--shard-token-file", files["same"]],
         "--shard-token-file holds the same token as --token-file"),
        (["--shard-token-file", str(tmp_path / "missing")], "--shard-token-file " + str(tmp_path / "missing")),
    ]:
        for join in ([], ["--join", "127.0.0.1:5000"]):
            parse = server.shard_host_options_from if join else server.options_from
            with pytest.raises(UsageError, match=re.escape(message)):
                parse(server_args(*join, *argv))
    with pytest.raises(UsageError, match="--join with --token-file needs --shard-token-file too"):
        server.shard_host_options_from(server_args("--join", "127.0.0.1:5000", "--token-file", files["token"]))


def test_a_coordinator_alone_has_no_shards_of_its_own():
    options = server.options_from(server_args("--shards", "0"))
    assert options.num_shards == 0 and options.coordinator.host == "127.0.0.1"


def test_server_packs_the_job_with_its_config(tmp_path):
    job_file = tmp_path / "myjob.py"
    job_file.write_text("def main(ctx, steps=1):\n    return {'steps': steps}\n")
    options = server.options_from(server_args("--shards", "3", "--job", f"{job_file}:main",
                                              "--job-config", '{"steps": 7}', "--heartbeat-timeout", "4"))
    assert options.num_shards == 3
    assert options.coordinator.job.name == f"{job_file}:main"
    assert json.loads(options.coordinator.job.config_json) == {"steps": 7}
    assert options.coordinator.heartbeat_timeout.total_seconds() == 4


def sample_status():
    response = pb.StatusResponse(generation=12, job="workers.regression:main",
                                 store=pb.StoreAddress(host="127.0.0.1", port=4000))
    response.shards.add(name="shard0", role=pb.ROLE_SHARD, alive=True, state="alive", pid=10,
                        metrics={"dynamic.rows": 100_000, "dynamic.admitted": 123_456, "dynamic.evicted": 23_456,
                                 "dynamic.bytes": 12_582_912, "dynamic.rows_on_disk": 250_000,
                                 "dynamic.disk_bytes": 6_000_000})
    response.workers.add(name="worker0", role=pb.ROLE_WORKER, alive=False, state="dead", step=2**40,
                         metrics={"loss": 0.25}, reason="no heartbeat for 5.1 s")
    response.workers.add(name="worker1", role=pb.ROLE_WORKER, alive=True, state="alive", trainer_group=1)
    response.groups.add(group=0, generation=3, members=["worker0"], backend="gloo")
    response.groups.add(group=1, generation=1, members=["worker1"], backend="gloo")
    response.trainer_groups_gone.append(0)
    return response


def test_status_json_has_plain_numbers_and_role_names():
    status = ctl.status_as_dict(sample_status())
    assert status["generation"] == 12
    assert status["shards"][0] == {**status["shards"][0], "name": "shard0", "alive": True, "role": "shard"}
    assert status["shards"][0]["metrics"]["dynamic.rows"] == 100_000
    worker = status["workers"][0]
    assert (worker["name"], worker["alive"], worker["step"], worker["metrics"]) == ("worker0", False, 2**40,
                                                                                    {"loss": 0.25})
    assert status["clients"] == []
    json.dumps(status)


def test_status_table_counts_a_restarted_shard_once_and_lists_its_exited_process():
    response = pb.StatusResponse(generation=4)
    response.shards.add(name="shard0", role=pb.ROLE_SHARD, alive=True, state="alive", pid=10)
    response.shards.add(name="shard1", role=pb.ROLE_SHARD, alive=False, state="exited", pid=11,
                        reason="process exited with code -9")
    response.shards.add(name="shard1", role=pb.ROLE_SHARD, alive=True, state="alive", pid=12)
    table = ctl.format_status(response)
    assert "shards (2 alive of 2)" in table and "(process exited with code -9)" in table
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("  shard1")] == [
        ["shard1", "exited"], ["shard1", "alive"]]


def test_status_table_lists_every_member():
    table = ctl.format_status(sample_status())
    assert "generation 12" in table and "shards (1 alive of 1)" in table and "workers (1 alive of 2)" in table
    assert "worker0    dead" in table and "loss=0.25  (no heartbeat for 5.1 s)" in table
    # A shard's dynamic tables on its one line, whole numbers in full: its rows in memory, then on disk.
    shard = next(line for line in table.splitlines() if "shard0" in line)
    assert shard.endswith("dynamic.admitted=123456 dynamic.bytes=12582912 dynamic.disk_bytes=6000000 "
                          "dynamic.evicted=23456 dynamic.rows=100000 dynamic.rows_on_disk=250000")
    # Each trainer group's newest view; a group with no live worker for the server's grace says it is gone.
    assert [line for line in table.splitlines() if line.startswith("trainer group")] == [
        "trainer group 0: generation 3, gloo, ranks worker0  (gone: no live worker; others take over its followed "
        "parts)",
        "trainer group 1: generation 1, gloo, ranks worker1"]


def test_server_ships_the_group_size_with_the_job():
    options = server.options_from(server_args("--shards", "2", "--group-size", "3"))
    assert options.coordinator.job.group_size == 3
    assert options.coordinator.group_settle == datetime.timedelta(seconds=2)  # GROUP_SETTLE
    options = server.options_from(server_args("--shards", "2", "--group-size", "3", "--group-settle", "30"))
    assert options.coordinator.group_settle == datetime.timedelta(seconds=30)
    assert options.coordinator.job.name == "paramserver.jobs.ctr:main"
    assert not options.coordinator.job.exports.directory
    assert options.coordinator.group_gone_after == datetime.timedelta(seconds=60)  # GROUP_GONE_AFTER
    gone_after = server.options_from(server_args("--shards", "2", "--group-gone-after", "5")).coordinator
    assert gone_after.group_gone_after == datetime.timedelta(seconds=5)
    with pytest.raises(server.UsageError, match="--group-gone-after must not be negative"):
        server.options_from(server_args("--shards", "2", "--group-gone-after", "-1"))


def test_server_ships_live_export_settings_with_the_job_and_workers_read_them(tmp_path, monkeypatch):
    from paramserver.checkpoint.records import LiveExportSettings
    monkeypatch.chdir(tmp_path)
    options = server.options_from(server_args("--export-dir", "live", "--export-every", "50",
                                              "--storage-options", '{"anon": true}', "--keep-exports", "2"))
    exports = LiveExportSettings.from_message(options.coordinator.job.exports)
    assert exports == LiveExportSettings(directory=str(tmp_path / "live"), every_steps=50, base_every=24,
                                         storage_options={"anon": True}, keep=2)


@pytest.mark.parametrize("hook, options, expected", [
    (None, [], {}),
    ("powersgd", ["rank=2", "start_iter=10", "error_feedback=false"],
     {"hook": "powersgd", "hook_options": {"rank": 2, "start_iter": 10, "error_feedback": False}}),
    ("bf16", [], {"hook": "bf16", "hook_options": {}}),
])
def test_worker_hook_flags_become_job_arguments(hook, options, expected):
    assert worker.hook_overrides(hook, options) == expected


@pytest.mark.parametrize("hook, options, message", [
    ("gzip", [], "--comm-hook 'gzip': choose one of allreduce, fp16, bf16"),
    (None, ["rank=2"], "--comm-hook-option needs --comm-hook"),
    ("powersgd", ["rank"], "--comm-hook-option 'rank' is not KEY=VALUE"),
])
def test_worker_hook_flags_are_checked(hook, options, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        worker.hook_overrides(hook, options)


def test_ps_demo_shares_the_job_files_among_its_workers():
    args = argparse.Namespace(shards=2, workers=3, steps=None,
                              job_config=json.dumps({"data": {"train": "/data/*.gz"}}))
    assert demo._job_config(args)["data"] == {"train": "/data/*.gz", "workers": 3}
    args.job_config = json.dumps({"data": {"train": "/data/*.gz", "workers": 2}})
    assert demo._job_config(args)["data"]["workers"] == 2  # as given
    args.job_config = json.dumps({"data": {"train": "/data/", "follow": True}})
    assert "workers" not in demo._job_config(args)["data"]  # a followed input: the trainer group deals it


#: In a fresh interpreter: a coordinator service without a store (so without torch) on a real port, and
#: ps-ctl's status, checkpoint and shutdown against it, imports done at call time included.
CTL_ALONE = """
import datetime, sys, concurrent.futures, grpc
from paramserver.control.membership import Membership
from paramserver.control.protocol import pb
from paramserver.control.service import CoordinatorService, ServiceSettings, generic_handler
from paramserver.cli import ctl
service = CoordinatorService(Membership(datetime.timedelta(seconds=5)), ServiceSettings(
    store=pb.StoreAddress(host="127.0.0.1", port=1), job=None, heartbeat_interval=datetime.timedelta(seconds=1),
    heartbeat_timeout=datetime.timedelta(seconds=5)), request_shutdown=lambda reason: None)
server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
server.add_generic_rpc_handlers((generic_handler(service),))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
codes = [ctl.main(["--connect", f"127.0.0.1:{port}", *argv]) for argv in (["status"], ["status", "--json"],
                                                                        ["checkpoint", "--timeout", "5"], ["shutdown"])]
server.stop(0)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fsspec", "cloudpickle")
               or m.startswith(("paramserver.shards", "paramserver.ddp", "paramserver.optim", "paramserver.train",
                                "paramserver.checkpoint")))
print(codes, heavy)
"""


def test_ps_ctl_starts_without_torch_which_only_its_export_loads():
    # ps-ctl talks gRPC: status, checkpoint and shutdown start in a fraction of the time torch takes to import.
    import subprocess
    import sys
    loaded = subprocess.run([sys.executable, "-c", CTL_ALONE], capture_output=True, text=True, timeout=60, check=True)
    # checkpoint: refused with FAILED_PRECONDITION (no checkpoint directory), exit 1; the others done.
    assert loaded.stdout.strip().splitlines()[-1] == "[0, 0, 1, 0] []", loaded.stdout + loaded.stderr


def typed_job(ctx, rate: float, layers: Optional[List[int]] = None, pair: Tuple[int, str] = (1, "a"),
              flag: bool = False, **more):
    """A job whose config ``check_config`` judges: required, Optional, nested, tuple, bool and ``**kwargs``."""


@pytest.mark.parametrize("config, message", [
    ({"rate": 1, "layers": [2, 3], "pair": [4, "b"], "flag": True, "other": "taken by **more"}, None),
    ({"rate": 0.5, "layers": None}, None),
    ({}, "job 'typed' needs 'rate'"),
    ({"rate": "fast"}, "'rate' of job 'typed' must be float, got \"fast\""),
    ({"rate": True}, "'rate' of job 'typed' must be float, got true"),
    ({"rate": 1, "layers": [1, 2.5]}, r"'layers' of job 'typed' must be Optional\[List\[int\]\], got \[1, 2.5\]"),
    ({"rate": 1, "pair": [1]}, r"'pair' of job 'typed' must be Tuple\[int, str\], got \[1\]"),
    ({"rate": 1, "flag": 0}, "'flag' of job 'typed' must be bool, got 0"),
])
def test_a_job_config_is_checked_against_the_signature_and_annotated_types(config, message):
    if message is None:
        check_config(typed_job, config, "typed", "--job-config")
        return
    with pytest.raises(JobConfigError, match=f"^--job-config: {message}"):
        check_config(typed_job, config, "typed", "--job-config")
