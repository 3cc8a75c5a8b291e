"""``ps-server``: start a cluster's coordinator and its shard servers on this machine, or add shards to one.

    ps-server --shards 4 [--host H] [--port P] [--job JOB] [--job-config JSON]
              [--group-size N [--group-settle S] [--group-gone-after S]]
              [--stop-after-workers N]
              [--checkpoint-dir D|URL [--checkpoint-every STEPS|SECONDSs] [--keep-checkpoints K]] [--restore D|URL]
              [--export-dir D|URL [--export-every STEPS] [--export-base-every N] [--keep-exports N]]
              [--storage-options JSON]
              [--token-file F] [--shard-token-file S] [--admin-token-file A] [--tls-cert C --tls-key K]
              [--heartbeat-timeout S] [--coordinator-grace S] [--state-dir D] [--push-log DIR|off]
              [--metrics-port P]
    ps-server --join HOST:PORT --shards 4 [--host H] [--shard-prefix P] [--token-file F --shard-token-file S]
              [--tls-ca PEM] [--coordinator-grace S] [--push-log DIR|off] [--metrics-port P]

Prints ``ps-server ready at HOST:PORT (...)`` once every shard has joined;
SIGTERM/SIGINT (or ``ps-ctl shutdown``) stops members, shards and itself.
With ``--state-dir`` it journals the cluster there, and a ps-server started
again with the same flags and directory on the same address takes the
running cluster back (its members, their groups, the shards it started);
SIGTERM/SIGINT then end this process alone (a pod moved elsewhere), and
``ps-ctl shutdown`` stops the cluster.  Members go on without an answering
coordinator for ``--coordinator-grace`` (60 s by default).
With ``--join`` it runs no coordinator: its shards join the cluster whose
coordinator is at HOST:PORT, it prints ``ps-server joined ...`` once they
serve, and ends when they are stopped (SIGTERM, or the cluster's shutdown).

Shards join with a credential of their own, which the cluster token does
not give: ``--shard-token-file`` on both ps-servers, or, on a coordinator
with ``--token-file`` and no shard token file, a secret it makes for its own
shards (then no other host's shards can join).  ``--admin-token-file``:
a third secret that ``ps-ctl checkpoint``, ``shutdown`` and ``export``
through the cluster must carry; without it any holder of the cluster token
may make those calls (a warning at start says so when there is a token).

The job's config (``--job-config``) is checked against the job function's
signature and annotated types before anything starts; a checkpoint
directory on this machine that cannot be written is refused at start.
Exit codes (``runtime.exit_codes``): 0 shut down cleanly, 1 failed, 2
refused (bad flags or config).
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import sys
import tempfile
from typing import TYPE_CHECKING, Optional

from ..control import DEFAULT_PORT, TlsFiles
from ..control.groups import GROUP_GONE_AFTER, GROUP_SETTLE
from ..control.protocol import HEARTBEAT_INTERVAL, pb
from ..control.security import AdminCredential, ShardCredential
from ..processes import start_fork_server
from ..runtime.exit_codes import EXIT_FAILED, EXIT_REFUSED
from ..runtime.job import DEFAULT_JOB, JobConfigError, JobError, pack_job
from ..runtime.shard_policy import MAX_RESTARTS, SHARD_PRELOAD
from .common import (UsageError, add_admin_token_file, add_coordinator_grace, coordinator_grace_from, add_log_level, add_metrics_port, add_storage_options, add_threads, add_token_file,
                     admin_token_from, command_main, coordinator_address, location_from,
                     data_plane_host, job_config_from, metrics_port_from, own_host, secret_from, setup_logging,
                     threads_from, token_from)

if TYPE_CHECKING:  # (imported where it is used: the row store's module loads torch)
    from ..shards.server.row_store.stores import RowStoreOptions


#: Flags that configure the coordinator, refused with ``--join`` (which runs none) unless left at their defaults.
COORDINATOR_FLAGS = ("port", "job", "job_config", "group_size", "group_settle", "group_gone_after", "checkpoint_dir",
                     "checkpoint_every", "checkpoint_keep", "restore", "storage_options", "export_dir", "export_every",
                     "export_base_every", "keep_exports", "tls_cert", "tls_key", "heartbeat_timeout",
                     "stop_after_workers", "admin_token_file", "state_dir", "store_name")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=1, metavar="N",
                        help="shard server processes to run on this host (default 1; 0: a coordinator only, "
                             "whose shards other hosts add with --join)")
    parser.add_argument("--host", default=None,
                        help="address to listen on, for the coordinator, the store and the shards (default "
                             "127.0.0.1; with --join: the address of the interface facing the coordinator)")
    parser.add_argument("--join", metavar="HOST:PORT",
                        help="run no coordinator: add this host's shards to the cluster whose ps-server is at "
                             "HOST:PORT (takes --shards, --host, --shard-prefix, --token-file, "
                             "--shard-token-file, --tls-ca, --metrics-port)")
    parser.add_argument("--shard-prefix", metavar="P",
                        help="shard names are P0, P1, ... (default 'shard'; with --join 'shard_' and this host's "
                             "address, e.g. shard_10_0_0_2_0): unique in the cluster")
    parser.add_argument("--tls-ca", metavar="PEM",
                        help="with --join: the coordinator speaks TLS; trust this certificate")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"coordinator port (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--job", default=DEFAULT_JOB,
                        help=f"what workers run: package.module:function or file.py:function (default {DEFAULT_JOB})")
    parser.add_argument("--job-config", default="{}", metavar="JSON",
                        help="keyword arguments for the job, a JSON object")
    parser.add_argument("--group-size", type=int, default=0, metavar="N",
                        help="workers per trainer group, each one DDP process group (default 0: every worker "
                             "in one group)")
    parser.add_argument("--group-settle", type=float, default=GROUP_SETTLE.total_seconds(), metavar="SECONDS",
                        help="a trainer group that is not full starts training (or goes on after losing a member) "
                             "once its workers stayed the same this long; a full group starts at once (default "
                             f"{GROUP_SETTLE.total_seconds():.0f})")
    parser.add_argument("--group-gone-after", type=float, default=GROUP_GONE_AFTER.total_seconds(),
                        metavar="SECONDS",
                        help="a trainer group left this long with no live worker is gone: other groups may take "
                             "over the parts of a followed input it had under way, from their start (default "
                             f"{GROUP_GONE_AFTER.total_seconds():.0f}; where a restarted worker rejoins sooner, "
                             "the group keeps its parts)")
    parser.add_argument("--stop-after-workers", type=int, default=0, metavar="N",
                        help="a batch job's server (torchx, Slurm): shut down, as on SIGTERM, once N workers "
                             "have left and none is running (default 0: run until stopped)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="write checkpoints under DIR, a path or fsspec URL (s3://bucket/prefix) every member "
                             "reaches; a shard process that dies is restarted from the newest one")
    parser.add_argument("--checkpoint-every", metavar="N|Ns", default=None,
                        help="checkpoint every N training steps (500) or every N seconds (300s)")
    parser.add_argument("--keep-checkpoints", "--checkpoint-keep", dest="checkpoint_keep", type=int, default=3,
                        metavar="K", help="committed checkpoints to keep (default 3); older ones are deleted, "
                                          "never the one --restore read")
    parser.add_argument("--restore", metavar="DIR",
                        help="start from a checkpoint: a checkpoint directory, or a checkpoint root (its newest "
                             "valid checkpoint), a path or URL; the number of shards may differ from the one "
                             "that wrote it")
    parser.add_argument("--convert-rows", action="store_true",
                        help="with --restore: a table whose rows the checkpoint holds in another type than the "
                             "job's (float32, float16, bfloat16) is converted (to half precision: to nearest); "
                             "without it such a restore is refused, naming the table and the types")
    parser.add_argument("--export-dir", metavar="DIR",
                        help="trainer group 0 writes live exports under DIR (a path or fsspec URL): a base, then "
                             "deltas of the rows changed, that paramserver.serving.load(DIR) serves and refresh() "
                             "follows")
    parser.add_argument("--export-every", type=int, default=None, metavar="STEPS",
                        help="a live export every STEPS training steps (default 100), and one when the job stops")
    parser.add_argument("--export-base-every", type=int, default=None, metavar="N",
                        help="every N-th live export is a base, the others deltas (default 24)")
    parser.add_argument("--keep-exports", type=int, default=None, metavar="N",
                        help="keep the newest N live-export bases with their deltas; older chains are removed "
                             "(one log line each), each at the earliest 5 minutes after the base that superseded "
                             "it (PARAMSERVER_EXPORT_READ_GRACE seconds), so a reader loading it finishes; the "
                             "newest chain is never removed (default: every export stays)")
    add_storage_options(parser, "--checkpoint-dir, --restore and --export-dir (handed to every member that "
                                "writes there)")
    add_token_file(parser)
    parser.add_argument("--shard-token-file", metavar="S",
                        help="file holding the shard token, a second secret that only shards carry: a Join as a "
                             "shard without it is refused (the cluster token admits workers and clients only). "
                             "Give the coordinator and every --join host the same file; a coordinator with "
                             "--token-file and none makes one up for its own shards, and then no --join host "
                             "can add shards")
    add_admin_token_file(parser, "file holding the admin token, a third secret that only operators carry: "
                                 "Checkpoint and Shutdown (ps-ctl checkpoint, shutdown, export through the "
                                 "cluster) without it are refused with PERMISSION_DENIED. Without it, any holder "
                                 "of the cluster token may make them")
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS only, with this certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    parser.add_argument("--shard-restarts", type=int, default=MAX_RESTARTS, metavar="N",
                        help=f"restart a lost shard process at most N times (default {MAX_RESTARTS}); past that, "
                             "workers are told at once that it is gone")
    parser.add_argument("--push-log", metavar="DIR",
                        help="where each shard logs the pushes it applied since its last checkpoint part, on this "
                             "host's local disk (DIR/<shard name>), so that a shard process restarted after a crash "
                             "comes back with every update: default <--state-dir>/push-log, or a temporary folder "
                             "removed at the end; 'off' for none (a restarted shard then rolls back to its "
                             "checkpoint). Only with checkpoints: the log is cut as each one commits")
    parser.add_argument("--row-store", metavar="DIR",
                        help="keep the rows of dynamic tables that their memory does not hold, with their optimizer "
                             "state, in files under DIR on this host's local disk (DIR/<shard name>, removed when "
                             "the shard stops): a row evicted for capacity is kept there and read back when its id "
                             "returns. DIR must exist and be writable")
    parser.add_argument("--row-memory", metavar="SIZE",
                        help="with --row-store: the memory each shard's dynamic tables' rows may take in all "
                             "(e.g. 512M, 4G), shared by the tables without a capacity of their own")
    parser.add_argument("--row-store-engine", metavar="ENGINE",
                        help="what keeps a row store's records: log (the default) or rocksdb (docs/row-store.md)")
    parser.add_argument("--heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                        help="declare a member dead after this long without a heartbeat "
                             "(default 5, or $PARAMSERVER_HEARTBEAT_TIMEOUT)")
    add_coordinator_grace(parser, "this host's shards serve on")
    parser.add_argument("--state-dir", metavar="DIR",
                        help="keep the coordinator's journal in DIR (made if missing; on storage that outlives "
                             "this process, a volume kept across restarts): members, their credentials, trainer "
                             "groups, generations, the job's run, checkpoint requests. A ps-server started again "
                             "with the same flags and DIR on the same address takes the running cluster back")
    parser.add_argument("--store-name", metavar="NAME",
                        help="the name members reach the rendezvous store by (default: --host): a stable DNS "
                             "name that resolves to --host (on Kubernetes the pod's, ps-coordinator-0.paramserver), "
                             "so that members find the store again when the coordinator comes back on another "
                             "address")
    add_metrics_port(parser, "the coordinator on P, shard i on P+1+i")
    add_threads(parser, "each shard server (1 unless set: a shard gets its parallelism from its RPC threads)")
    add_log_level(parser)


def shard_restarts_from(args) -> int:
    if args.shard_restarts < 0:
        raise UsageError(f"--shard-restarts must be 0 or more, got {args.shard_restarts}")
    return args.shard_restarts


def shard_prefix(value: str) -> str:
    """``--shard-prefix``: the start of torch RPC names: no '.' (torch refuses them) and no '-' (an open RPC
    group lists its members in its store as ``name-rank``, and cuts a name at its first '-')."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,50}", value):
        raise UsageError(f"--shard-prefix {value!r}: a letter, then up to 50 letters, digits or '_'")
    return value


def shard_host_options_from(args):
    """``ps-server --join``'s options (``ShardHostOptions``); the coordinator's own flags are refused, naming
    them."""
    from ..runtime.shard_host import ShardHostOptions
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    given = [f"--{name.replace('_', '-')}" for name in COORDINATOR_FLAGS
             if getattr(args, name) != defaults.get_default(name)]
    if given:
        raise UsageError(f"--join runs no coordinator: {', '.join(given)} belong{'s' if len(given) == 1 else ''} "
                         "on the coordinator's ps-server")
    if args.shards < 1:
        raise UsageError(f"--shards must be at least 1, got {args.shards}")
    address = coordinator_address(args.join)
    host = own_host(args.host, address)
    prefix = shard_prefix(args.shard_prefix if args.shard_prefix is not None
                          else "shard_" + re.sub(r"[^A-Za-z0-9]", "_", host) + "_")
    token = token_from(args)
    shard_token = shard_token_from(args, token)
    if token and not shard_token:
        raise UsageError("--join with --token-file needs --shard-token-file too: a coordinator with a token "
                         "admits shards only with the shard token (give it the same --shard-token-file)")
    return ShardHostOptions(coordinator=address, num_shards=args.shards, host=host, prefix=prefix,
                            token=token, shard_token=shard_token, max_restarts=shard_restarts_from(args),
                            tls=TlsFiles(ca=args.tls_ca) if args.tls_ca else None,
                            log_level=args.log_level, metrics_port=metrics_port_from(args, 1 + args.shards),
                            coordinator_grace=coordinator_grace_from(args), push_log=args.push_log,
                            row_store=row_store_from(args))


def options_from(args):
    """The coordinator's ``ps-server``'s options (``ServerOptions``)."""
    from ..control import CoordinatorSettings
    from ..runtime.server import ServerOptions
    if args.tls_ca:
        raise UsageError("--tls-ca is for --join (trusting the coordinator); a coordinator takes --tls-cert and "
                         "--tls-key")
    if args.host is None:
        args.host = "127.0.0.1"
    data_plane_host("--host", args.host)
    if args.shards < 0:
        raise UsageError(f"--shards must be 0 (a coordinator only: shards come from ps-server --join) or more, "
                         f"got {args.shards}")
    prefix = shard_prefix(args.shard_prefix if args.shard_prefix is not None else "shard")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be 0-65535, got {args.port}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    config = job_config_from(args.job_config)
    if args.group_size < 0:
        raise UsageError(f"--group-size must be 0 (one group of every worker) or positive, got {args.group_size}")
    if args.group_settle < 0:
        raise UsageError(f"--group-settle must not be negative, got {args.group_settle}")
    if args.group_gone_after < 0:
        raise UsageError(f"--group-gone-after must not be negative, got {args.group_gone_after}")
    if args.stop_after_workers < 0:
        raise UsageError(f"--stop-after-workers must be 0 (run until stopped) or more, got {args.stop_after_workers}")
    try:
        job = pack_job(args.job, config, group_size=args.group_size)
    except JobConfigError as error:  # names --job-config and the key itself
        raise UsageError(str(error)) from None
    except JobError as error:
        raise UsageError(f"--job: {error}") from error
    exports = live_exports_from(args)
    if exports is not None:
        job.exports.CopyFrom(exports)
    token = token_from(args)
    shard_token = shard_token_from(args, token)
    settings = dict(host=args.host, port=args.port, token=token, job=job,
                    shard_credential=ShardCredential(shard_token) if shard_token else None,
                    admin_token=admin_token_of_server(args, token, shard_token),
                    tls=TlsFiles(cert=args.tls_cert, key=args.tls_key) if args.tls_cert else None,
                    checkpoints=checkpoint_options_from(args))
    if args.heartbeat_timeout is not None:
        timeout = datetime.timedelta(seconds=args.heartbeat_timeout)
        if timeout <= HEARTBEAT_INTERVAL:
            raise UsageError(f"--heartbeat-timeout must exceed the {HEARTBEAT_INTERVAL.total_seconds():.0f} s "
                             f"heartbeat interval, got {args.heartbeat_timeout}")
        settings["heartbeat_timeout"] = timeout
    settings["group_settle"] = datetime.timedelta(seconds=args.group_settle)
    settings["group_gone_after"] = datetime.timedelta(seconds=args.group_gone_after)
    settings["hold_workers_until_ready"] = args.shards > 0
    if args.state_dir:
        settings["state_dir"] = args.state_dir
    if args.store_name:
        settings["store_name"] = data_plane_host("--store-name", args.store_name)
    return ServerOptions(num_shards=args.shards, coordinator=CoordinatorSettings(**settings),
                         log_level=args.log_level, shard_prefix=prefix, max_restarts=shard_restarts_from(args),
                         metrics_port=metrics_port_from(args, 1 + args.shards),
                         stop_after_workers=args.stop_after_workers,
                         coordinator_grace=coordinator_grace_from(args),
                         push_log=args.push_log if args.push_log is not None or not args.state_dir else
                         os.path.join(args.state_dir, "push-log"),
                         row_store=row_store_from(args))


_SIZE_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def size_from(flag: str, text: str) -> int:
    """Bytes of a size written as a number with an optional unit (K, M, G, T: powers of 1024; ``iB``/``B`` may
    follow), ``UsageError`` naming ``flag`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise UsageError(f"{flag} {text!r}: a size such as 512M or 4G")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def row_store_from(args) -> Optional["RowStoreOptions"]:
    """The shards' row store (``--row-store``, ``--row-memory``, ``--row-store-engine``), or ``None``; a
    folder missing or not writable, an engine or a size that is none, refused naming the flag.  (The row store's
    module is imported only here: with it, torch, which a ps-server without a row store does not load.)"""
    if args.row_store is None:
        if args.row_memory is not None or args.row_store_engine is not None:
            given = "--row-memory" if args.row_memory is not None else "--row-store-engine"
            raise UsageError(f"{given} needs --row-store: the rows that do not fit go there")
        return None
    from ..shards.server.row_store.stores import RowStoreOptions, check_folder
    try:
        check_folder(args.row_store)
        memory = size_from("--row-memory", args.row_memory) if args.row_memory is not None else None
        if args.row_store_engine is None:
            return RowStoreOptions(os.path.abspath(args.row_store), memory=memory)
        return RowStoreOptions(os.path.abspath(args.row_store), args.row_store_engine, memory)
    except ValueError as error:
        raise UsageError(str(error)) from None


def live_exports_from(args) -> Optional["pb.LiveExportSettings"]:
    """``--export-*``'s settings for the job, or ``None`` when there are no live exports."""
    if not args.export_dir:
        if args.export_every is not None or args.export_base_every is not None or args.keep_exports is not None:
            raise UsageError("--export-every, --export-base-every and --keep-exports need --export-dir")
        return None
    for flag, value in (("--export-every", args.export_every), ("--export-base-every", args.export_base_every),
                        ("--keep-exports", args.keep_exports)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    directory = location_from("--export-dir", args.export_dir, args)
    return pb.LiveExportSettings(directory=directory.url, every_steps=args.export_every or 100,
                                 base_every=args.export_base_every or 24, keep=args.keep_exports or 0,
                                 storage_options_json=json.dumps(dict(directory.storage_options))
                                 if directory.storage_options else "")


def writable_here(flag: str, directory) -> None:
    """A directory on this machine's filesystem (a ``Location``; the coordinator writes checkpoints' manifests
    there) is made if missing and must take a file; one that cannot is refused now, not at the first
    checkpoint.  A URL's store is not reached here (it may not be up yet): what fails there is reported when
    it is used."""
    if not directory.is_local:
        return
    path = pathlib.Path(directory.path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".ps-server-probe-"):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {directory.url}: cannot write there: {error.strerror or error}") from None


def shard_token_from(args, token: Optional[str]) -> Optional[str]:
    """``--shard-token-file``'s token; it must differ from the cluster token, or roles would not be scoped."""
    shard_token = secret_from("--shard-token-file", args.shard_token_file)
    if shard_token is not None and ShardCredential(shard_token).same_as(token):
        raise UsageError("--shard-token-file holds the same token as --token-file: give shards a secret of their "
                         "own, or every holder of the cluster token could join as a shard")
    return shard_token


def admin_token_of_server(args, token: Optional[str], shard_token: Optional[str]) -> Optional[str]:
    """``--admin-token-file``'s token; it must differ from the cluster and shard tokens, or any worker (or
    shard) could stop the cluster."""
    admin_token = admin_token_from(args)
    if admin_token is not None:
        admin = AdminCredential(admin_token)
        for flag, other in (("--token-file", token), ("--shard-token-file", shard_token)):
            if admin.same_as(other):
                raise UsageError(f"--admin-token-file holds the same token as {flag}: give operators a secret of "
                                 "their own")
    return admin_token


def checkpoint_options_from(args):
    """``--checkpoint-*``'s ``CheckpointOptions``, or ``None`` when there are no checkpoints."""
    from ..control.checkpoints import CheckpointOptions
    if args.checkpoint_keep < 1:
        raise UsageError(f"--keep-checkpoints must be at least 1, got {args.checkpoint_keep}")
    if args.convert_rows and not args.restore:
        raise UsageError("--convert-rows needs --restore")
    if not args.checkpoint_dir and not args.restore:
        if args.checkpoint_every is not None:
            raise UsageError("--checkpoint-every needs --checkpoint-dir")
        if args.storage_options is not None and not args.export_dir:
            raise UsageError("--storage-options needs --checkpoint-dir, --restore or --export-dir")
        return None
    # Named URLs checked here (a missing extra, an unknown protocol: one line, exit 2); nothing is reached yet.
    directory = location_from("--checkpoint-dir", args.checkpoint_dir, args) if args.checkpoint_dir else None
    if directory is not None:
        writable_here("--checkpoint-dir", directory)
    restore = location_from("--restore", args.restore, args) if args.restore else None
    every_steps, every_seconds = 0, 0.0
    if args.checkpoint_every is not None:
        text = args.checkpoint_every.strip()
        try:
            if text.endswith("s"):
                every_seconds = float(text[:-1])
                valid = every_seconds > 0 and math.isfinite(every_seconds)
            else:
                every_steps = int(text)
                valid = every_steps > 0
        except ValueError:
            valid = False
        if not valid:
            raise UsageError(f"--checkpoint-every must be a positive number of steps (500) or seconds (300s), "
                             f"got {args.checkpoint_every!r}")
    options = (directory or restore).storage_options
    return CheckpointOptions(directory=directory.url if directory else None, every_steps=every_steps,
                             every_seconds=every_seconds, keep=args.checkpoint_keep,
                             restore=restore.url if restore else None, storage_options=options,
                             convert_rows=args.convert_rows)


def run(args) -> int:
    setup_logging("ps-server", args)
    try:
        threads_from(args)  # --threads reaches the shard processes through the environment
    except UsageError as error:
        print(f"ps-server: {error}", file=sys.stderr)
        return EXIT_REFUSED
    if args.shards > 0:
        # The shard processes come from a fork server: started first, it imports their code (torch) while this
        # process imports the coordinator's below, instead of after it.  This module imports neither.
        start_fork_server(SHARD_PRELOAD)
    try:
        options = shard_host_options_from(args) if args.join else options_from(args)
    except UsageError as error:
        print(f"ps-server: {error}", file=sys.stderr)
        return EXIT_REFUSED
    from ..runtime.server import serve
    from ..runtime.shard_host import serve_shard_host
    try:
        return serve_shard_host(options) if args.join else serve(options)
    except (OSError, ValueError) as error:
        print(f"ps-server: {error}", file=sys.stderr)
        return EXIT_FAILED


def main(argv=None) -> int:
    return command_main("ps-server", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
