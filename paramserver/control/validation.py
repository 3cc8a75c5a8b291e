"""Checking what members send the coordinator, before it touches any state.

Owns the rules a well-formed request follows (field sizes, characters,
finite numbers) and ``RequestError``, which carries the gRPC status code
and a message naming the field at fault.  Out-of-order requests (an
unknown member, a stale heartbeat) are membership's to judge, not ours.
"""

import ipaddress
import math
import re
from typing import Mapping

import grpc

from .protocol import ROLE_NAMES, pb

MAX_NAME_CHARS = 64
MAX_HOST_CHARS = 253
MAX_TEXT_CHARS = 512
#: The most metrics one heartbeat or leave may carry (a CTR worker's final figures are some 40).
MAX_METRICS = 64
MAX_METRIC_NAME_CHARS = 64
MAX_LABELS = 16
MAX_LABEL_CHARS = 128
MAX_MACHINE_CHARS = 256
MAX_MEMBER_ID_CHARS = 64

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


class RequestError(Exception):
    """A request the coordinator refuses: ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


#: A member's credential (``Assignment.credential``) is far shorter; a longer one is no credential.
MAX_CREDENTIAL_CHARS = 128

def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_name(field: str, value: str) -> None:
    if not value:
        raise invalid(f"{field} is empty")
    if len(value) > MAX_NAME_CHARS:
        raise invalid(f"{field} has {len(value)} characters, at most {MAX_NAME_CHARS} allowed")
    if not _NAME.match(value):
        raise invalid(f"{field} {value!r} may only use letters, digits, '.', '_' and '-'")


def check_host(field: str, value: str) -> None:
    if not value:
        raise invalid(f"{field} is empty")
    if len(value) > MAX_HOST_CHARS:
        raise invalid(f"{field} has {len(value)} characters, at most {MAX_HOST_CHARS} allowed")
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if not _HOSTNAME.match(value):
        raise invalid(f"{field} {value!r} is neither an IP address nor a host name")


def check_text(field: str, value: str, limit: int = MAX_TEXT_CHARS) -> None:
    if len(value) > limit:
        raise invalid(f"{field} has {len(value)} characters, at most {limit} allowed")


def check_member_id(value: str) -> None:
    if not value:
        raise invalid("member_id is empty: call Join first and send the member_id it returned")
    check_text("member_id", value, MAX_MEMBER_ID_CHARS)


def check_metrics(field: str, metrics: Mapping[str, float]) -> None:
    if len(metrics) > MAX_METRICS:
        raise invalid(f"{field} has {len(metrics)} entries, at most {MAX_METRICS} allowed")
    for key, value in metrics.items():
        if not key or len(key) > MAX_METRIC_NAME_CHARS or not _NAME.match(key):
            raise invalid(f"{field} key {key[:80]!r} must be 1-{MAX_METRIC_NAME_CHARS} characters "
                          "from letters, digits, '.', '_' and '-'")
        if not math.isfinite(value):
            raise invalid(f"{field}[{key!r}] is {value}, not a finite number")


def validate_join(request: pb.JoinRequest) -> None:
    if request.role not in ROLE_NAMES:
        raise invalid(f"role must be one of {sorted(pb.Role.Name(r) for r in ROLE_NAMES)}, "
                      f"got {pb.Role.Name(request.role) if request.role in pb.Role.values() else request.role}")
    check_name("name", request.name)
    check_host("host", request.host)
    labels = request.capabilities.labels
    if len(labels) > MAX_LABELS:
        raise invalid(f"capabilities.labels has {len(labels)} entries, at most {MAX_LABELS} allowed")
    for key, value in labels.items():
        check_name("capabilities.labels key", key)
        check_text(f"capabilities.labels[{key!r}]", value, MAX_LABEL_CHARS)
    check_text("capabilities.machine", request.capabilities.machine, MAX_MACHINE_CHARS)


def validate_heartbeat(request: pb.HeartbeatRequest) -> None:
    check_member_id(request.member_id)
    if request.sequence == 0:
        raise invalid("sequence must start at 1 and increase with every heartbeat")
    check_metrics("metrics", request.metrics)
    if len(request.credential) > MAX_CREDENTIAL_CHARS:
        raise invalid(f"credential has {len(request.credential)} characters, at most {MAX_CREDENTIAL_CHARS} allowed")


def validate_leave(request: pb.LeaveRequest) -> None:
    check_member_id(request.member_id)
    check_text("reason", request.reason)
    check_metrics("metrics", request.metrics)


def validate_shutdown(request: pb.ShutdownRequest) -> None:
    check_text("reason", request.reason)
