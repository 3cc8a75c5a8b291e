"""The control plane's wire protocol: generated messages, the service's name, limits.

Owns the import of the generated stubs (with an error that says how to
build them when they are missing) and the protocol constants both ends
agree on.  Messages are built and read elsewhere.
"""

import datetime

try:
    from .v1 import coordinator_pb2 as pb
    from .v1 import coordinator_pb2_grpc as pb_grpc
except ImportError as error:  # pragma: no cover - only on a source tree never installed
    raise ImportError(
        "paramserver's gRPC stubs are missing: they are generated from protos/ when the package is "
        "installed; run `pip install -e .` (or `make venv`) in the source tree") from error

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
DEFAULT_PORT = 50051

#: Timeouts (``datetime.timedelta``) and their environment overrides.
HEARTBEAT_INTERVAL = datetime.timedelta(seconds=1)
HEARTBEAT_TIMEOUT = datetime.timedelta(seconds=5)
HEARTBEAT_TIMEOUT_ENV = "PARAMSERVER_HEARTBEAT_TIMEOUT"
#: How long a member goes on without an answering coordinator before it gives the cluster up
#: (``--coordinator-grace``): long enough for Kubernetes to start the coordinator's pod again after an
#: eviction or a node drain (a pod scheduled on another node, its image pulled or cached, the interpreter and
#: torch imported, the journal read), with room to spare, and short enough that a cluster whose coordinator
#: is gone for good frees its machines within about a minute.
COORDINATOR_GRACE = datetime.timedelta(seconds=60)
COORDINATOR_GRACE_ENV = "PARAMSERVER_COORDINATOR_GRACE"
#: How long a checkpoint asked for (``ps-ctl checkpoint``, ``ps-ctl export``) is waited for, unless said.
CHECKPOINT_WAIT = datetime.timedelta(seconds=120)

#: The transport refuses messages above this many bytes (RESOURCE_EXHAUSTED);
#: the handlers' own field limits (``validation``) are far below it, so a
#: merely oversized field gets INVALID_ARGUMENT with its name.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: Metadata key carrying the cluster token (``authorization: Bearer <token>``).
AUTH_METADATA_KEY = "authorization"
AUTH_SCHEME = "Bearer "

ROLE_NAMES = {pb.ROLE_SHARD: "shard", pb.ROLE_WORKER: "worker", pb.ROLE_CLIENT: "client"}
