"""Hosts for multi-host tests: Linux network namespaces on one bridge.

``make_hosts(n)`` builds ``n`` namespaces, each with one interface
(``eth0``, address ``10.77.0.<i+1>/24``) plugged into a bridge that lives in
a namespace of its own, so nothing of this machine's own network is
touched; ``Hosts.remove()`` deletes them all (deleting a namespace deletes
its interfaces).  It needs root and the ``ip`` command: ``NamespacesUnavailable``
says why they could not be made, for the test to skip with.
"""

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import List

SUBNET = "10.77.0"


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no permission)."""


@dataclass
class Hosts:
    names: List[str]                 # one network namespace per host
    addresses: List[str]             # each host's address on the shared network
    _all: List[str] = field(default_factory=list)  # every namespace made, the bridge's included
    _links: List[str] = field(default_factory=list)  # veth ends made in this machine's own namespace

    def remove(self) -> None:
        for name in reversed(self._all):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        for link in self._links:  # gone with their namespace, unless moving them there failed
            subprocess.run(["ip", "link", "delete", link], capture_output=True, timeout=30)
        self._all.clear()
        self._links.clear()


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NamespacesUnavailable(f"'ip {' '.join(args)}' failed: {result.stderr.strip()}")


def make_hosts(count: int) -> Hosts:
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("the 'ip' command (iproute2) is not installed")
    tag = f"ps{os.getpid() % 100000}"  # unique per test process; interface names stay under 15 characters
    hosts = Hosts(names=[f"{tag}-h{i}" for i in range(count)], addresses=[f"{SUBNET}.{i + 1}" for i in range(count)])
    bridge_ns = f"{tag}-sw"
    try:
        _ip("netns", "add", bridge_ns)
        hosts._all.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for index, (name, address) in enumerate(zip(hosts.names, hosts.addresses)):
            _ip("netns", "add", name)
            hosts._all.append(name)
            host_end, bridge_end = f"{tag}a{index}", f"{tag}b{index}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", bridge_end)
            hosts._links.append(host_end)
            _ip("link", "set", host_end, "netns", name)
            _ip("link", "set", bridge_end, "netns", bridge_ns)
            _ip("-n", bridge_ns, "link", "set", bridge_end, "master", "br0", "up")
            _ip("-n", name, "link", "set", host_end, "name", "eth0")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except BaseException:
        hosts.remove()
        raise
    return hosts
