"""Which address a member advertises (``paramserver.control.addresses``): the
interface facing the coordinator, and the coordinator's refusal of a
loopback address advertised from another host, through the service too."""

import datetime

import grpc
import pytest

from paramserver.control.addresses import address_facing, is_loopback, loopback_from_afar, peer_host
from paramserver.control.membership import Membership
from paramserver.control.protocol import pb
from paramserver.control.service import CoordinatorService, ServiceSettings
from paramserver.control.validation import RequestError


def test_the_address_facing_a_loopback_coordinator_is_loopback():
    assert address_facing("127.0.0.1:50051") == "127.0.0.1"
    assert address_facing("localhost:50051") == "127.0.0.1"


def test_an_unresolvable_coordinator_is_named():
    with pytest.raises(ValueError, match="no-such-host.invalid"):
        address_facing("no-such-host.invalid:50051")


@pytest.mark.parametrize("peer, host", [
    ("ipv4:10.0.0.3:51234", "10.0.0.3"), ("ipv6:[::1]:51234", "::1"), ("unix:/tmp/s", None), ("", None),
])
def test_grpc_peers_are_parsed(peer, host):
    assert peer_host(peer) == host


def test_loopback_is_recognized_without_resolving_names():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.4.5") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("node-3.cluster.local")


@pytest.mark.parametrize("advertised, peer, refused", [
    ("127.0.0.1", "ipv4:10.0.0.3:5000", True),     # another host claiming loopback
    ("localhost", "ipv4:10.0.0.3:5000", True),
    ("127.0.0.1", "ipv4:127.0.0.1:5000", False),   # all on one machine
    ("10.0.0.3", "ipv4:10.0.0.3:5000", False),
    ("10.0.0.3", "ipv4:127.0.0.1:5000", False),    # this host's address, reached over loopback
    ("127.0.0.1", "", False),                      # peer unknown (in-process calls)
])
def test_loopback_from_another_host_is_refused(advertised, peer, refused):
    reason = loopback_from_afar(advertised, peer)
    assert (reason is not None) == refused
    if refused:
        assert "10.0.0.3" in reason and advertised in reason


def test_the_service_refuses_such_a_join_and_keeps_serving():
    service = CoordinatorService(
        Membership(datetime.timedelta(seconds=5)),
        ServiceSettings(store=pb.StoreAddress(host="10.0.0.1", port=1), job=None,
                        heartbeat_interval=datetime.timedelta(seconds=1), heartbeat_timeout=datetime.timedelta(seconds=5)),
        request_shutdown=lambda reason: None)
    request = pb.JoinRequest(role=pb.ROLE_WORKER, name="w", host="127.0.0.1", capabilities=pb.Capabilities(pid=7))
    with pytest.raises(RequestError) as refused:
        service.handle("Join", request.SerializeToString(), peer="ipv4:10.0.0.3:40000")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "reached the coordinator from 10.0.0.3" in refused.value.message
    request.host = "10.0.0.3"
    assert service.handle("Join", request.SerializeToString(), peer="ipv4:10.0.0.3:40000").rpc_name == "worker0"
