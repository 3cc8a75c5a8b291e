"""Options every command shares: where the coordinator is, the tokens, TLS, logging, the metrics port.

Owns parsing them and turning them into the objects the runtime takes
(a token string, ``TlsFiles``, a coordinator client, a ``--timeout``),
with errors that name the flag at fault (exit codes: ``runtime.exit_codes``,
one scheme for every command); also reading
``--shard-token-file`` and ``--admin-token-file`` (secret files, read as
the token is).  Storage (fsspec) is imported only when a flag names a
location, so that ``ps-ctl status`` starts without it.
"""

import argparse
import datetime
import json
import os
from typing import TYPE_CHECKING, Callable, Optional

from ..control import (DEFAULT_PORT, CoordinatorClient, CoordinatorError, NotAuthenticated, NotPermitted, TlsFiles,
                       read_token_file)
from ..control.addresses import address_facing
from ..logs import configure_logging, default_log_level
from ..runtime.exit_codes import EXIT_FAILED, EXIT_REFUSED
from ..runtime.threads import THREADS_ENV

if TYPE_CHECKING:
    from ..filesystems import Location


#: The longest a command waits for the cluster (``--timeout``).
MAX_WAIT = datetime.timedelta(hours=1)


class UsageError(Exception):
    """A command-line problem; the command prints it and exits ``EXIT_REFUSED`` (2, as argparse does)."""


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=default_log_level(),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log verbosity (default: $PARAMSERVER_LOG_LEVEL or INFO)")


def add_threads(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"intra-op threads of {what} (default: sized to this host's cores and the cluster's "
                             "processes on it; $PARAMSERVER_THREADS)")


def threads_from(args) -> None:
    """``--threads``: the process (and the processes it starts) use that many intra-op threads."""
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be at least 1, got {args.threads}")
        os.environ[THREADS_ENV] = str(args.threads)


def add_token_file(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", metavar="F",
                        help="file holding the cluster token; every control-plane call carries it")


def add_admin_token_file(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--admin-token-file", metavar="A", help=what)


def admin_token_from(args) -> Optional[str]:
    return secret_from("--admin-token-file", args.admin_token_file)


def add_connect(parser: argparse.ArgumentParser, required: bool = True, when: str = "") -> None:
    """``--connect`` and the credentials that go with it; ``when`` says, for a flag not ``required``, when
    it is needed."""
    parser.add_argument("--connect", required=required, metavar="HOST:PORT",
                        help=f"the coordinator (ps-server) to talk to; port {DEFAULT_PORT} by default{when}")
    add_token_file(parser)
    parser.add_argument("--tls-ca", metavar="PEM",
                        help="speak TLS, trusting this certificate (a self-signed server's own cert.pem)")


def add_metrics_port(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help=f"serve Prometheus metrics at http://HOST:P/metrics on --host ({what}; 0 picks a "
                             "free port; default: no metrics)")


def add_coordinator_grace(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--coordinator-grace", type=float, default=None, metavar="SECONDS",
                        help=f"while the coordinator does not answer, {what} this long for it to come back (a "
                             "coordinator started again with the same flags and --state-dir takes the cluster "
                             "back); past it the cluster is lost (default 60, or $PARAMSERVER_COORDINATOR_GRACE: "
                             "a Kubernetes pod restarted after an eviction or a node drain)")


def coordinator_grace_from(args):
    """``--coordinator-grace`` as a ``timedelta`` (``None`` when not given)."""
    if args.coordinator_grace is None:
        return None
    if not (args.coordinator_grace > 0):
        raise UsageError(f"--coordinator-grace must be positive, got {args.coordinator_grace}")
    return datetime.timedelta(seconds=args.coordinator_grace)


def metrics_port_from(args, ports_needed: int = 1):
    """``--metrics-port`` (``None`` when not given); ``ports_needed`` consecutive ports from it must exist."""
    port = args.metrics_port
    if port is None:
        return None
    if not 0 <= port < 65536:
        raise UsageError(f"--metrics-port must be 0-65535, got {port}")
    if port and port + ports_needed - 1 > 65535:
        raise UsageError(f"--metrics-port {port} needs ports {port}-{port + ports_needed - 1} (one per process), "
                         "past 65535; give a lower port, or 0 for free ones")
    return port


def token_from(args) -> Optional[str]:
    return secret_from("--token-file", args.token_file)


def secret_from(flag: str, path: Optional[str]) -> Optional[str]:
    """The token in the file ``flag`` names (``None`` when the flag was not given)."""
    if not path:
        return None
    try:
        return read_token_file(path)
    except OSError as error:
        raise UsageError(f"{flag} {path}: {error.strerror}") from error
    except ValueError as error:
        raise UsageError(f"{flag}: {error}") from error


def coordinator_address(value: str) -> str:
    """``HOST:PORT`` (``HOST`` alone means the default port)."""
    if not value:
        raise UsageError("--connect needs HOST:PORT")
    if value.startswith("["):  # [IPv6]:port
        return value if "]:" in value else f"{value}:{DEFAULT_PORT}"
    host, sep, port = value.rpartition(":")
    if not sep:
        return f"{value}:{DEFAULT_PORT}"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--connect {value!r} is not HOST:PORT")
    return value


def data_plane_host(flag: str, value: str) -> str:
    """An IPv4 address or a host name: what the data plane's interface lookup supports."""
    if ":" in value:
        raise UsageError(f"{flag} {value!r}: give an IPv4 address or a host name (the data plane binds IPv4 "
                         "interfaces)")
    if value in ("0.0.0.0", ""):
        raise UsageError(f"{flag} {value!r}: give this machine's address, not a wildcard; the cluster's "
                         "ports bind to that address only")
    return value


def own_host(value: Optional[str], coordinator: str) -> str:
    """``--host`` of a member: as given (checked), or the address of this machine's interface facing the
    coordinator (so a member on another host never advertises 127.0.0.1)."""
    if value is not None:
        return data_plane_host("--host", value)
    try:
        return address_facing(coordinator)
    except ValueError as error:
        raise UsageError(f"--host not given and {error}; pass --host") from error


def job_config_from(value: str) -> dict:
    """``--job-config``: a JSON object of the job's keyword arguments."""
    try:
        config = json.loads(value)
    except json.JSONDecodeError as error:
        raise UsageError(f"--job-config is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise UsageError("--job-config must be a JSON object")
    return config


def add_storage_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--storage-options", metavar="JSON", default=None,
                        help=f"fsspec options for {what}'s filesystem, a JSON object (for example "
                             '\'{"endpoint_url": "http://minio:9000"}\'); fsspec\'s own configuration and the '
                             "standard AWS_* variables apply too")


def location_from(flag: str, value: str, args) -> "Location":
    """``value`` of ``flag`` (a path or fsspec URL) with ``--storage-options``; an empty one, or a URL whose
    protocol needs a package that is missing (``MissingStorageExtra``, naming the extra) or is unknown, is a
    ``UsageError``."""
    if not value.strip():
        raise UsageError(f"{flag} is empty: give a path or a URL")
    from ..filesystems import locate, parse_storage_options
    try:
        options = parse_storage_options(getattr(args, "storage_options", None))
        return locate(value, options)
    except (ImportError, ValueError) as error:
        raise UsageError(f"{flag} {value}: {error}" if not str(error).startswith(value) else f"{flag}: {error}") \
            from None


def client_tls(args) -> Optional[TlsFiles]:
    return TlsFiles(ca=args.tls_ca) if args.tls_ca else None


def coordinator_client(args) -> CoordinatorClient:
    """A client of the coordinator ``--connect`` names, with ``--token-file``, ``--admin-token-file`` and
    ``--tls-ca``."""
    if not args.connect:
        raise UsageError(f"{args.command} needs --connect HOST:PORT")
    return CoordinatorClient(coordinator_address(args.connect), token=token_from(args), tls=client_tls(args),
                             admin_token=admin_token_from(args))


def exit_code_for(error: CoordinatorError) -> int:
    """``EXIT_REFUSED`` when the coordinator refused the caller's credentials (a missing or wrong token, no
    admin token), as ps-worker does; ``EXIT_FAILED`` for the rest (unreachable, no answer, a command failed)."""
    return EXIT_REFUSED if isinstance(error, (NotAuthenticated, NotPermitted)) else EXIT_FAILED


def timeout_from(args, most: datetime.timedelta = MAX_WAIT) -> datetime.timedelta:
    """``--timeout SECONDS``: more than 0, at most ``most``."""
    if not 0 < args.timeout <= most.total_seconds():  # NaN fails this too
        raise UsageError(f"--timeout must be more than 0 and at most {most.total_seconds():.0f} seconds, got "
                         f"{args.timeout:g}")
    return datetime.timedelta(seconds=args.timeout)


def setup_logging(process: str, args) -> None:
    configure_logging(process, args.log_level)


def command_main(prog: str, doc: str, add_arguments: Callable, run: Callable[..., int], argv=None) -> int:
    """A command's ``main``: parse ``argv`` with its ``add_arguments``, then ``run``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.strip().split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
