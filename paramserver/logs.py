"""Log set-up for paramserver's processes: one readable line per event, to stderr.

Owns the log format and level of ps-server, ps-worker, ps-ctl and every
shard server (``--log-level``, defaulting to ``PARAMSERVER_LOG_LEVEL``,
else INFO), and ending a process at once with its log written
(``exit_now``).
"""

import logging
import os
import sys
from typing import Optional

LOG_LEVEL_ENV = "PARAMSERVER_LOG_LEVEL"


def default_log_level() -> str:
    return os.environ.get(LOG_LEVEL_ENV, "INFO").upper()


def configure_logging(process: str, level: Optional[str] = None, replace: bool = True) -> None:
    """Log lines look like ``2026-11-21 13:05:01,123 shard0 INFO paramserver.x: message``.

    ``replace=False`` leaves a process that set up logging itself alone.
    """
    if not replace and logging.getLogger().handlers:
        return
    logging.basicConfig(level=(level or default_log_level()).upper(), stream=sys.stderr, force=True,
                        format=f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s")


def exit_now(code: int) -> None:
    """Write out the log and the standard streams, then end the process without the interpreter's teardown
    (torch's destructors can take seconds, or wait on peers that are gone)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
