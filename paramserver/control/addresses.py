"""Which address a member advertises: the one it was told to bind, or the one facing the coordinator.

Owns choosing a member's own address when none is given (the local
address of the interface that packets to the coordinator leave by: on a
multi-homed host that is the address the coordinator, and the rest of the
cluster on that network, can reach), and the coordinator's check at join
that a member reaching it from another host does not advertise a loopback
address, which no other host could reach.  Pure socket and string work:
no gRPC server, no torch.
"""

import ipaddress
import socket
from typing import Optional, Tuple

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def split_address(address: str) -> Tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ``[v6]:port`` too."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def address_facing(coordinator: str) -> str:
    """This machine's IPv4 address on the interface facing ``coordinator`` (``HOST:PORT``).

    A UDP socket is "connected" to the coordinator (no packet is sent) and
    asked for its local address: the kernel's routing decides the interface.
    A coordinator on loopback gives 127.0.0.1.
    """
    host, port = split_address(coordinator)
    try:
        target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve the coordinator's host {host!r} to an IPv4 address: {error}") from error
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(target)
        except OSError as error:
            raise ValueError(f"no route from this machine to the coordinator {coordinator}: {error.strerror}") \
                from error
        return probe.getsockname()[0]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address; names other than localhost's are not
    resolved (the coordinator must not block on DNS while answering a join)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peer_host(grpc_peer: str) -> Optional[str]:
    """The address in a gRPC peer string (``ipv4:10.0.0.3:51234``, ``ipv6:[::1]:51234``); ``None`` otherwise."""
    kind, sep, rest = grpc_peer.partition(":")
    if not sep or kind not in ("ipv4", "ipv6"):
        return None
    host, _, _port = rest.rpartition(":")
    return host.strip("[]") or None


def loopback_from_afar(advertised: str, grpc_peer: str) -> Optional[str]:
    """Why a member advertising ``advertised`` cannot be taken in, seen from ``grpc_peer``; ``None`` if it can.

    A member that reached the coordinator from another host's address but
    advertises a loopback one would be unreachable by every other host.
    """
    seen_from = peer_host(grpc_peer)
    if seen_from is None or not is_loopback(advertised) or is_loopback(seen_from):
        return None
    return (f"host {advertised!r} is a loopback address, but this member reached the coordinator from "
            f"{seen_from}: no other host could reach its data plane; give its address on the cluster's "
            f"network (--host {seen_from}, or leave --host out to use the interface facing the coordinator)")
