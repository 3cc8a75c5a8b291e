"""The coordinator's journal (``paramserver.control.journal``) and what goes in it: a membership taken back by a
coordinator started again keeps its members, groups and numbering; members re-attach with their credential;
one that does not is declared dead a heartbeat timeout after the start; a journal is written whole or not,
readable by its owner alone; a coordinator on a real gRPC port with a token and TLS, started again, keeps the
shard token it made and takes its members back."""

import datetime
import json
import stat

import grpc
import pytest

from commands import self_signed_certificate
from paramserver.control.groups import TrainerGroups
from paramserver.control.journal import Journal, JournalError
from paramserver.control.membership import DEAD, Membership
from paramserver.control.protocol import pb
from paramserver.control.validation import RequestError

TIMEOUT = datetime.timedelta(seconds=5)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _membership(clock, group_size=2):
    return Membership(TIMEOUT, clock=clock, groups=TrainerGroups(group_size))


def _join(membership, role=pb.ROLE_WORKER, name="host"):
    return membership.join(pb.JoinRequest(role=role, name=name, host="127.0.0.1",
                                          capabilities=pb.Capabilities(pid=7)))


def test_a_membership_taken_back_keeps_members_groups_and_numbering_and_lets_in_only_the_credentialed():
    clock = Clock()
    before = _membership(clock)
    _join(before, pb.ROLE_SHARD, "shard0")
    workers = [_join(before) for _ in range(2)]
    for sequence, worker in enumerate(workers, 1):
        before.heartbeat(pb.HeartbeatRequest(member_id=worker.member_id, sequence=sequence, step=40))
    view = before.status().groups[0]
    assert list(view.members) == ["worker0", "worker1"] and view.generation == 1
    snapshot = json.loads(json.dumps(before.snapshot()))  # as the journal holds it
    assert all("credential" not in m for m in snapshot["members"])  # only digests

    clock.now += 30
    after = _membership(clock)
    after.restore(snapshot)
    assert after.generation > before.generation
    assert {m.rpc_name for m in after.unattached()} == {"shard0", "worker0", "worker1"}
    with pytest.raises(RequestError) as refused:
        after.heartbeat(pb.HeartbeatRequest(member_id=workers[0].member_id, sequence=9,
                                            credential=workers[1].credential))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    _, _, _, view_after = after.heartbeat(pb.HeartbeatRequest(member_id=workers[0].member_id, sequence=9,
                                                              step=55, credential=workers[0].credential))
    assert view_after == view  # the same generation of the same members: nobody re-forms
    newcomer = _join(after, pb.ROLE_WORKER)
    assert (newcomer.rpc_name, newcomer.rpc_rank, newcomer.index) == ("worker2", 4, 2)
    assert newcomer.trainer_group == 1  # group 0 is full with the two it had
    assert newcomer.job_run == workers[0].job_run  # the same run of the job: workers were alive

    assert {m.rpc_name for m in after.unattached()} == {"shard0", "worker1"}


def test_a_member_that_never_re_attaches_is_declared_dead_a_heartbeat_timeout_after_the_start():
    clock = Clock()
    before = _membership(clock)
    worker = _join(before)
    after = _membership(clock)
    clock.now += 60
    after.restore(before.snapshot())
    clock.now += TIMEOUT.total_seconds() + 0.1
    (lost,) = after.sweep()
    assert lost.member_id == worker.member_id and lost.state == DEAD


def test_the_journal_is_written_whole_and_read_back(tmp_path):
    journal = Journal(str(tmp_path / "state"))
    assert journal.read() is None
    assert journal.write({"membership": {"generation": 3}}) is True
    assert journal.write({"membership": {"generation": 3}}) is False  # unchanged: not written again
    assert Journal(str(tmp_path / "state")).read()["membership"] == {"generation": 3}
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["coordinator.json"]  # no temporary file left
    (tmp_path / "state" / "coordinator.json").write_text("{not json")
    with pytest.raises(JournalError, match="is not JSON"):
        Journal(str(tmp_path / "state")).read()
    assert stat.S_IMODE((tmp_path / "state" / "coordinator.json").stat().st_mode) == 0o600


def test_a_coordinator_with_a_token_and_tls_started_again_keeps_its_shard_token_and_takes_its_members_back(
        tmp_path):
    """In this process, on real gRPC ports: a coordinator with a cluster token, TLS and a shard token it made
    (no ``--shard-token-file``) journals that token; started again on the same port it hands the same one to
    its shards, a shard and a worker re-attach through TLS with the token and their credentials, a shard
    started again joins with the token it was given before, and a worker joining is told the same live
    exports and a checkpoint request number above the journaled one."""
    from paramserver.control import CoordinatorClient, CoordinatorServer, CoordinatorSettings, TlsFiles
    from paramserver.control.checkpoints import CheckpointOptions
    cert, key = self_signed_certificate(tmp_path)
    tls = TlsFiles(cert=str(cert), key=str(key), ca=str(cert))
    job = pb.JobSpec(name="job", exports=pb.LiveExportSettings(directory=str(tmp_path / "exports"), every_steps=50))
    token = "cluster-token"

    def server(port):
        settings = CoordinatorSettings(host="127.0.0.1", port=port, token=token, tls=tls, job=job,
                                       state_dir=str(tmp_path / "state"),
                                       checkpoints=CheckpointOptions(directory=str(tmp_path / "checkpoints")))
        return CoordinatorServer(settings, request_shutdown=lambda reason: None).start()

    first = server(0)
    made = first.shard_credential
    assert made is not None and made.made_for_this_run
    shards = CoordinatorClient(first.address, token=token, tls=TlsFiles(ca=tls.ca), shard_token=made.secret)
    workers = CoordinatorClient(first.address, token=token, tls=TlsFiles(ca=tls.ca))
    try:
        shard = shards.join(pb.ROLE_SHARD, "shard0", "127.0.0.1")
        worker = workers.join(pb.ROLE_WORKER, "host", "127.0.0.1")
        asked = first.checkpoints.request("ps-ctl checkpoint")
        first.stop()  # lost: the journal it wrote last stays
        journal = tmp_path / "state" / "coordinator.json"
        assert stat.S_IMODE(journal.stat().st_mode) == 0o600
        assert json.loads(journal.read_text())["shard_secret"] == made.secret
        second = server(first.port)
        try:
            assert second.shard_credential == made  # what the shards it started carry
            for client, member in ((shards, shard), (workers, worker)):
                client.call("Heartbeat", pb.HeartbeatRequest(member_id=member.member_id, sequence=2,
                                                             credential=member.credential))
            assert not second.membership.unattached()
            again = shards.join(pb.ROLE_SHARD, "shard1", "127.0.0.1")  # e.g. a shard process restarted
            assert again.rpc_name == "shard1"
            newcomer = workers.join(pb.ROLE_WORKER, "host", "127.0.0.1")
            assert newcomer.job.exports.directory == str(tmp_path / "exports")
            assert second.checkpoints.request("ps-ctl checkpoint") == asked + 1
        finally:
            second.stop()
    finally:
        shards.close()
        workers.close()
