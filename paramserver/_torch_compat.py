"""Every private torch API and every piece of torch's error text that paramserver relies on.

torch gives no public way to do some things an elastic parameter server
needs: leave an open RPC group cleanly when a peer died, join one while a
member lies dead, heal the group's member list in its store, tell which
trainer a dist_autograd context came from, or recognise a failed gloo/NCCL
collective (those arrive as a plain ``RuntimeError``).  Each such reliance is named here, once, with the reason;
``tests/test_torch_compat.py`` has a test per item that fails loudly when a
torch release changes it.  Nothing else in the package touches a private
torch name or parses torch's error text.

Names used inside TorchScript functions (which cannot call Python helpers)
are listed in ``TORCHSCRIPT_PRIVATE_OPS`` and checked by the same tests.
"""

import ast
import builtins
import datetime
import logging
import re
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from .logs import one_line
from .torchscript import compiling

logger = logging.getLogger(__name__)

# --- The open RPC group's store (torch/distributed/rpc/__init__.py, api.py) -------------------------------
# A process's n-th init_rpc prefixes its store keys with "rpc_prefix_<n-1>"; open-group members take a
# token under RPC_TOKEN_KEY to join or leave and list themselves under names/_ALL_WORKER_INFOS as
# "name-rank,".  The coordinator edits that list when a member dies without leaving
# (control/rendezvous.py), or every later join waits on the dead member.

#: The key prefix of a process's first ``init_rpc``; ``reset_rpc_init_counter`` makes every join use it.
RPC_STORE_PREFIX = "rpc_prefix_0"
#: Under ``RPC_STORE_PREFIX``: the prefix of the agents' names.
RPC_NAMES_PREFIX = "names"
#: Under ``RPC_STORE_PREFIX``: the membership token ("" when free, else the holder's token).
RPC_TOKEN_KEY = "RpcGroupManagementToken"
#: Under ``RPC_NAMES_PREFIX``: the member list.
RPC_MEMBER_LIST_KEY = "_ALL_WORKER_INFOS"
#: Under ``RPC_STORE_PREFIX``: the prefix of the agents' addresses (TensorPipe's ``nameToAddressStore_``): a
#: joining agent reads each listed member's address there, and each member reads the newcomer's there.
RPC_ADDRESSES_PREFIX = "addrs"
#: What a token's own key is set to once its holder is finished.
RPC_TOKEN_DONE = "Done"


def rpc_token(name: str, purpose: str) -> str:
    """The token a member ``name`` holds while it does ``purpose`` ("join", "leave"; ours: "removal")."""
    return f"Token_for_{name}_{purpose}"


def rpc_member_entry(name: str, rank: int) -> str:
    """One member's entry in the member list."""
    return f"{name}-{rank},"


def rpc_member_entries(names_store: dist.Store) -> List[str]:
    """The entries (``rpc_member_entry``) of the member list under ``names_store`` (the ``RPC_NAMES_PREFIX``
    store), in order; empty when there is none (read without waiting)."""
    if not names_store.check([RPC_MEMBER_LIST_KEY]):
        return []
    return [entry + "," for entry in names_store.get(RPC_MEMBER_LIST_KEY).decode().split(",") if entry]


def parse_rpc_member_entry(entry: str) -> Tuple[str, int]:
    """``(name, rank)`` of a member list's entry."""
    name, _, rank = entry.rstrip(",").rpartition("-")
    return name, int(rank)


def publish_rpc_member(rpc_store: dist.Store, name: str, rank: int, address: str) -> bool:
    """Write member ``name`` (``rank``, listening at ``address``) into an open group's store (the
    ``RPC_STORE_PREFIX`` one) as torch's agent does when it joins: its rank's name, its address, its entry
    at the member list's end unless listed.  Call it holding the group's membership token.  Returns
    whether the list lacked it."""
    dist.PrefixStore(RPC_ADDRESSES_PREFIX, rpc_store).set(name, address)
    names = dist.PrefixStore(RPC_NAMES_PREFIX, rpc_store)
    names.set(str(rank), name)
    entries = rpc_member_entries(names)
    entry = rpc_member_entry(name, rank)
    if entry in entries:
        return False
    names.set(RPC_MEMBER_LIST_KEY, "".join(entries + [entry]))
    return True


def rpc_member_address(rpc_store: dist.Store, name: str) -> Optional[str]:
    """The address member ``name`` published in an open group's store, or None (read without waiting)."""
    addresses = dist.PrefixStore(RPC_ADDRESSES_PREFIX, rpc_store)
    if not addresses.check([name]):
        return None
    return addresses.get(name).decode()


def reset_rpc_init_counter() -> None:
    """Make the next ``init_rpc`` use ``RPC_STORE_PREFIX``, however often this process joined before."""
    with rpc._init_counter_lock:
        rpc._init_counter = 0


# --- The RPC agent ------------------------------------------------------------------------------------------

def current_rpc_agent():
    """This process's RPC agent, or None when it has none (never joined, or left)."""
    if not rpc.api._is_current_rpc_agent_set():
        return None
    return rpc.api._get_current_rpc_agent()


def is_open_rpc_group(agent) -> bool:
    """Whether ``agent`` is in a group without a fixed world size (members join and leave)."""
    return not agent.is_static_group


def forget_rpc_peer(agent, peer: "rpc.WorkerInfo") -> None:
    """Drop ``peer`` (known to be dead) from ``agent``'s view of an open group, as its leaving would.

    Without it, this process's own leave waits on the dead peer.
    """
    agent._update_group_membership(peer, [], {}, False)


#: What a request to a peer whose process is gone fails with (tensorpipe's uv transport: nothing listens on
#: its port any more), as against a peer that is slow to answer.
_PEER_GONE_MARKER = "ECONNREFUSED"


def is_peer_gone(error: BaseException) -> bool:
    """Whether ``error`` (from an RPC) says its peer's process is gone: its connection was refused."""
    return _PEER_GONE_MARKER in str(error)


def forget_dead_peers_when_joining() -> None:
    """Make an open group's join skip a member that died without leaving, instead of hanging.

    torch's join (``backend_registry._tensorpipe_init_backend_handler``)
    asks every member listed in the store for its devices and tells each of
    them of the newcomer, inside the group's membership token.  A member that
    died a moment before (the coordinator takes it off the list only once it
    is declared dead, a heartbeat timeout later) refuses the connection; torch
    then calls ``rpc.shutdown()``, which waits for that same token to leave:
    the joining process hangs, and with it every trainer group that counts
    on it.  Installed once (by ``shards.peer.join``), this asks every member
    first and forgets (``forget_rpc_peer``) each whose process is gone
    (``is_peer_gone``) before torch's own steps run; any other failure is
    torch's to handle, as before.
    """
    from torch.distributed.rpc import backend_registry
    original = getattr(backend_registry, "_set_devices_and_reverse_device_map", None)
    if original is None or not hasattr(backend_registry, "_get_device_infos"):
        return  # a torch that joins otherwise: joins go on as torch has them (its check in compat_peer fails)
    if getattr(original, "forgets_dead_peers", False):
        return

    def forgetting_dead_peers(agent):
        if is_open_rpc_group(agent):
            me = agent.get_worker_info().name
            for info in agent.get_worker_infos():
                if info.name == me:
                    continue
                try:
                    rpc.rpc_sync(info.name, backend_registry._get_device_infos)
                except RuntimeError as error:
                    if not is_peer_gone(error):
                        raise
                    forget_rpc_peer(agent, info)
                    logger.warning("joining the RPC group without %s: its process is gone (%s)", info.name,
                                   one_line(error))
        return original(agent)

    forgetting_dead_peers.forgets_dead_peers = True
    backend_registry._set_devices_and_reverse_device_map = forgetting_dead_peers


def mark_leaving(agent) -> None:
    """Make ``agent`` (an open group's) leave the group's member list and count as shutting down, without
    closing anything yet: from now on its TensorPipe agent takes a pipe that errors (a peer closed it) as
    expected, instead of logging ``pipe closed`` or ``EOF`` (tensorpipe_agent.cpp, ``respond``: the warning
    is skipped only while ``shuttingDown_``, which ``join(shutdown=True)`` sets through ``leaveGroup`` and a
    plain ``shutdown`` never does).  It waits for this agent's own RPCs in flight to end, and must be
    called holding the group's membership token (it edits the member list)."""
    agent.join(shutdown=True)


def release_rrefs(timeout: datetime.timedelta) -> None:
    """Release the RRefs this process uses, waiting at most ``timeout`` for their owners' acknowledgement.

    ``rpc.shutdown`` does this with a fixed 100 s wait, which an RRef whose
    owner died (a lost shard) always runs into.
    """
    rpc.api._delete_all_user_and_unforked_owner_rrefs(timeout)


def tensorpipe_options(init_method: str, num_worker_threads: int, rpc_timeout: datetime.timedelta,
                       transports: Optional[Sequence[str]] = None) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options, with the transports restricted to ``transports`` when given.

    An open group's members must avoid the shared-memory transport, which
    fails between a member and one that joined after it.
    """
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, num_worker_threads=num_worker_threads,
                                           rpc_timeout=rpc_timeout.total_seconds(),
                                           _transports=list(transports) if transports else None)


def rpc_barrier(names: List[str]) -> None:
    """Wait until every peer in ``names`` reached this call (benchmarks line their rounds up with it)."""
    rpc.api._barrier(names)


# --- dist_autograd ------------------------------------------------------------------------------------------

#: A dist_autograd context id is its creating worker's id shifted left by this (torch/csrc/distributed/
#: autograd/context/container.h); the owners read the trainer behind a step from it.
AUTOGRAD_CONTEXT_WORKER_SHIFT = 48


def autograd_context_creator(context_id: int) -> int:
    """The RPC worker id of the process that created dist_autograd context ``context_id``."""
    return context_id >> AUTOGRAD_CONTEXT_WORKER_SHIFT


def check_autograd_context(context_id: int) -> None:
    """Raise ``RuntimeError`` unless ``context_id`` is a live dist_autograd context of this process.

    Checked before a step's RPCs go out, so that a stale context fails here
    and not on every owner.
    """
    dist_autograd._is_valid_context(context_id)


# --- TorchScript --------------------------------------------------------------------------------------------

def torchscript_enabled() -> bool:
    """Whether TorchScript compiles (``PYTORCH_JIT=0`` turns it off); owners then run optimizers in Python."""
    return bool(torch.jit._state._enabled)


def script_class(cls):
    """``torch.jit.script(cls)`` with ``cls``'s names resolved in its own methods' modules: scripting a class
    otherwise resolves its globals in the caller's frame (``torch.jit.script``'s default for classes), so a
    user's class calling helpers of its own module (``check_gradients``, ``RowStep``) would not compile when
    checked from elsewhere."""
    with compiling():
        return torch.jit.script(cls, _rcb=torch._jit_internal.createResolutionCallbackForClassMethods(cls))


#: Private operators called inside TorchScript code (optim/kernels.py, optim/qhm.py,
#: optim/functional_qhm.py: the fused and multi-tensor kernels torch.optim itself uses;
#: shards/server/optimizers.py: a push's row-sparse gradient built, and cut into runs of rows, without
#: the invariant checks its rows were checked for already) and private tensor methods
#: (shards/server/optimizers.py: a sparse gradient's indices and values without coalescing).
TORCHSCRIPT_PRIVATE_OPS = ("_fused_sgd_", "_foreach_mul_", "_foreach_add", "_foreach_add_", "_foreach_neg",
                           "_foreach_copy_", "_sparse_coo_tensor_unsafe")
TORCHSCRIPT_PRIVATE_TENSOR_METHODS = ("_values", "_nnz", "_indices")

_SCRIPT_ERROR = re.compile(r"builtins\.(\w+): (.*)", re.DOTALL)


def builtin_error_in_script_error(error: BaseException) -> Optional[Exception]:
    """The builtin exception (``ValueError``...) a ``torch.jit.Error`` wraps, or None.

    TorchScript raises every Python exception as ``torch.jit.Error`` whose
    text ends in "builtins.ValueError: message"; only the text has the type.
    """
    matches = list(_SCRIPT_ERROR.finditer(str(error)))
    if not matches:
        return None
    name, message = matches[-1].group(1), matches[-1].group(2).strip()
    exc_type = getattr(builtins, name, None)
    if isinstance(exc_type, type) and issubclass(exc_type, Exception):
        return exc_type(message)
    return None


# --- Errors across an RPC boundary --------------------------------------------------------------------------

_REMOTE_ERROR = re.compile(r"On WorkerInfo\([^\n]*\):\n(\w+)\((.*)\)\n")
_ERROR_LINE = re.compile(r"^(?:builtins\.)?(\w*(?:Error|Exception)): (.+)$")


def remote_error_cause(error: BaseException) -> str:
    """The essential "Type: message" of an error that may have crossed an RPC boundary.

    torch delivers an RPC target's exception as text: "On WorkerInfo(...):",
    the exception's repr, its traceback.  A TorchScript error's text holds the
    script traceback and ends with the "Type: message" that matters; a
    Python error raised under TorchScript reads "RuntimeError: ValueError: ...".
    """
    text = str(error)
    remote = _REMOTE_ERROR.search(text)
    if remote:
        kind, body = remote.group(1), remote.group(2)
        try:
            body = str(ast.literal_eval(body))
        except (ValueError, SyntaxError):
            pass
        text = f"{kind}: {body}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    matches = [m for m in map(_ERROR_LINE.match, lines) if m]
    if not matches:
        return lines[0] if lines else type(error).__name__
    kind, message = matches[-1].group(1), matches[-1].group(2)
    inner = _ERROR_LINE.match(message)
    while inner:
        kind, message = inner.group(1), inner.group(2)
        inner = _ERROR_LINE.match(message)
    return f"{kind}: {message}"


#: The error types a shard raises for a request it refuses (bad input, an optimizer that cannot apply it), as
#: opposed to a shard that is gone or timed out.
REFUSAL_TYPES = ("ValueError", "TypeError", "IndexError", "KeyError")


def is_remote_refusal(error: BaseException) -> bool:
    """Whether ``error`` (from an RPC) is the peer refusing the request (``REFUSAL_TYPES``), not the peer lost.

    Across a TorchScript RPC torch delivers every error as a ``RuntimeError`` whose text holds the original
    type: only the text can tell (``remote_error_cause``)."""
    if isinstance(error, (ValueError, TypeError, IndexError, KeyError)):
        return True
    return remote_error_cause(error).split(":", 1)[0] in REFUSAL_TYPES


# --- Collectives --------------------------------------------------------------------------------------------

_BACKEND_ERROR_MARKERS = ("gloo", "NCCL")


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective of the gloo or NCCL backend.

    torch raises ``DistError`` subclasses for some failures, but a peer that
    died mid-collective surfaces from ``Work.wait()``, DDP's backward and
    distributed autograd as a plain ``RuntimeError`` whose text names the
    backend's source ("third_party/gloo/...", "NCCL error").
    """
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return any(marker in text for marker in _BACKEND_ERROR_MARKERS)


# --- RRefs whose owner died -------------------------------------------------------------------------------

def forsake_rref_owners() -> None:
    """From now on, an RRef this process drops is not reported to its owner, as after ``rpc.shutdown``.

    For a process about to leave the data plane that still holds RRefs of a
    peer that died (a lost shard's process): torch reports every dropped
    RRef to its owner, and for an owner no longer in the group it logs an
    error with a C++ stack trace ("Error occurred when deletingUserRRef ...
    could not find destination id") for each one.  This tears down torch's
    RRef context, which ``rpc.shutdown`` does first thing: call it right
    before leaving, once the RRefs whose owners live were dropped (their
    owners are told as usual), and never in a process that owns RRefs other
    peers still use.
    """
    rpc.api._destroy_rref_context(True)
