"""The open RPC group's store connection (``paramserver.shards.group_store``), in one process: torch's agent
holds it behind a ``PrefixStore``; an operation whose connection broke connects again to the store's server made
anew on the same port, and while no server listens it fails within the reconnect bound."""

import datetime
import time

import pytest
import torch.distributed as dist

from paramserver.shards.group_store import SCHEME, ReconnectingStore, open_group_url, store_of


def _server(port: int = 0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)


def test_an_operation_after_the_server_was_made_anew_connects_again_and_one_while_it_is_gone_fails_bounded():
    server = _server()
    port = server.port
    store = ReconnectingStore("127.0.0.1", port, datetime.timedelta(seconds=10),
                              reconnect_within=datetime.timedelta(seconds=1))
    held = dist.PrefixStore("rpc_prefix_0", store)  # as torch's agent holds it: calls come back into Python
    held.set("a", "1")
    assert held.get("a") == b"1" and held.compare_set("token", "", "mine") == b"mine" and held.check(["a"])
    assert held.add("n", 2) == 2
    del server  # the coordinator hosting it died
    began = time.monotonic()
    with pytest.raises(dist.DistError):
        held.get("a")
    assert time.monotonic() - began < 8  # the reconnect bound (1 s), not the store's timeout (10 s)
    server = _server(port)  # a coordinator started again: its store, empty, on the same port
    held.set("b", "2")
    assert held.get("b") == b"2" and not held.check(["a"])  # the old contents went with the old server
    assert held.compare_set("token", "", "again") == b"again"
    reconnections = store.reconnections
    store.reconnect()  # told (a member re-attached): connects again at once, whatever the connection's state
    assert store.reconnections == reconnections + 1 and held.get("b") == b"2"
    del server


def test_an_open_group_s_url_takes_the_reconnecting_rendezvous_once_per_process():
    url = open_group_url("127.0.0.1", 1234)
    assert url == f"{SCHEME}://127.0.0.1:1234" and open_group_url("::1", 1234) == f"{SCHEME}://[::1]:1234"

    class Agent:  # what ``store_of`` reads of torch's agent
        store = dist.PrefixStore("rpc_prefix_0", dist.HashStore())

    assert store_of(Agent()) is None  # not one of ours
