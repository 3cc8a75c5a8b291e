"""The data plane's rendezvous: a c10d TCPStore that the coordinator hosts.

Owns the store's life (bound to the coordinator's host only, on a port
picked by the OS) and its upkeep when a member is lost.  torch RPC groups
without a fixed world size keep their member list in this store and take a
store "token" to join or leave; a member that dies without leaving stays
listed, so every later join would try to reach it and fail while holding
the token, and the whole group would stall.  ``remove_rpc_peer`` takes the
member off that list (taking the token the same way torch does, or
freeing it when the dead member died holding it), so the group heals.
A coordinator started again makes a new store, on the same port: the group's
members and their addresses come from its journal (``rpc_group`` read for it,
``restore_rpc_group`` written back), so a member joining later reaches them
all (each member's agent connects again to the new store,
``shards/group_store.py``).

The key names are torch's; ``paramserver._torch_compat`` names them (the
runtime makes every member join with the first ``init_rpc``'s prefix).
"""

import datetime
import logging
import socket
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .._torch_compat import (RPC_MEMBER_LIST_KEY, RPC_NAMES_PREFIX, RPC_STORE_PREFIX, RPC_TOKEN_DONE, RPC_TOKEN_KEY,
                             parse_rpc_member_entry, publish_rpc_member, rpc_member_address, rpc_member_entries,
                             rpc_member_entry, rpc_token)

logger = logging.getLogger(__name__)



class RendezvousStore:
    """A TCPStore server listening on ``host`` (a port of 0 picks a free one)."""

    def __init__(self, host: str, port: int = 0,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=30)):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bind the listening socket ourselves: TCPStore would listen on every interface.
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as error:
            self._socket.close()
            raise OSError(f"cannot listen on {host} for the rendezvous store: {error.strerror}") from error
        self._socket.listen(512)
        self.host = host
        self.port = self._socket.getsockname()[1]
        self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                   timeout=timeout, master_listen_fd=self._socket.fileno())
        self._socket.detach()  # the store's server owns the descriptor now and closes it
        self._rpc_store = dist.PrefixStore(RPC_STORE_PREFIX, self.store)
        self._names = dist.PrefixStore(RPC_NAMES_PREFIX, self._rpc_store)
        #: Members' addresses by (name, rank), read once (an agent's address never changes; a process started
        #: again under the same name joins under another rank).
        self._addresses: Dict[Tuple[str, int], str] = {}

    def remove_rpc_peer(self, rpc_name: str, rank: int,
                        timeout: datetime.timedelta = datetime.timedelta(seconds=30),
                        takeover_after: datetime.timedelta = datetime.timedelta(seconds=10)) -> bool:
        """Take a lost member off the RPC group's list; True when it was listed.

        When the member holds the group's token (it was joining or leaving),
        it gets ``takeover_after`` to finish (a member declared dead may only
        be slow); then the token is taken from it.
        """
        if not self._take_token(rpc_name, "removal", timeout, takeover_after):
            return False
        try:
            entries = rpc_member_entries(self._names)
            entry = rpc_member_entry(rpc_name, rank)
            if entry not in entries:
                return False
            entries.remove(entry)
            self._names.set(RPC_MEMBER_LIST_KEY, "".join(entries))
            self._addresses.pop((rpc_name, rank), None)
            logger.info("RPC group: removed %s (rank %d) from the store's member list", rpc_name, rank)
            return True
        finally:
            self._release_token(rpc_name, "removal")

    def _take_token(self, rpc_name: str, purpose: str, timeout: datetime.timedelta,
                    takeover_after: datetime.timedelta) -> bool:
        my_token = rpc_token(rpc_name, purpose)
        began = time.monotonic()
        its_tokens = (rpc_token(rpc_name, "join"), rpc_token(rpc_name, "leave"))
        while True:
            holder = self._rpc_store.compare_set(RPC_TOKEN_KEY, "", my_token).decode()
            if holder == my_token:
                return True
            waited = time.monotonic() - began
            if holder in its_tokens and waited > takeover_after.total_seconds():
                logger.warning("RPC group: %s still holds the membership token after %.0f s; taking it over",
                               rpc_name, waited)
                self._rpc_store.set(holder, RPC_TOKEN_DONE)
                self._rpc_store.set(RPC_TOKEN_KEY, my_token)
                return True
            if waited > timeout.total_seconds():
                logger.error("RPC group: could not take the membership token from %s to %s %s", holder, purpose,
                             rpc_name)
                return False
            time.sleep(0.05)

    def _release_token(self, rpc_name: str, purpose: str) -> None:
        self._rpc_store.set(RPC_TOKEN_KEY, "")
        self._rpc_store.set(rpc_token(rpc_name, purpose), RPC_TOKEN_DONE)

    def rpc_group(self) -> Optional[List[Tuple[str, int, str]]]:
        """The RPC group's members as the store lists them, with the address each published: ``(name, rank,
        address)``; None when a member is joining or leaving right now (it holds the group's membership token:
        a joining member is listed before its address is written).  For the journal: read without waiting,
        under the token, each address once."""
        reader = rpc_token("coordinator", "journal")
        if self._rpc_store.compare_set(RPC_TOKEN_KEY, "", reader).decode() != reader:
            return None
        try:
            group = []
            for entry in rpc_member_entries(self._names):
                name, rank = parse_rpc_member_entry(entry)
                address = self._addresses.get((name, rank))
                if address is None:
                    address = rpc_member_address(self._rpc_store, name)
                    if address is None:
                        continue
                    self._addresses[(name, rank)] = address
                group.append((name, rank, address))
            return group
        finally:
            self._release_token("coordinator", "journal")

    def restore_rpc_group(self, members: Sequence[Tuple[str, int, str]]) -> None:
        """Write ``members`` (``rpc_group()``'s, from the journal of the coordinator before this one) into this
        new store as torch's agents wrote them when they joined, so that a member joining later finds them
        and they find it."""
        if not self._take_token("coordinator", "restore", datetime.timedelta(seconds=30),
                                datetime.timedelta(seconds=0)):
            raise RuntimeError("the RPC group's membership token stayed taken in a store just made")
        try:
            for name, rank, address in members:
                publish_rpc_member(self._rpc_store, name, int(rank), address)
                self._addresses[(name, int(rank))] = address
        finally:
            self._release_token("coordinator", "restore")
        logger.info("RPC group: took back %d member%s from the journal: %s", len(members),
                    "" if len(members) == 1 else "s", ", ".join(name for name, _, _ in members) or "none")

    def close(self) -> None:
        self.store = None
        self._rpc_store = None
        self._names = None  # the last reference: the store's server stops and closes its socket
