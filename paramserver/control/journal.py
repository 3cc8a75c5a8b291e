"""The coordinator's journal: what a ps-server started again needs to take its running cluster back.

Owns one small JSON file, ``coordinator.json`` under ``ps-server --state-dir``
(a directory on storage that outlives the process: a volume kept across pod
restarts), written whole on each change (to a temporary file, then renamed
over the old one, so a reader finds either the old journal or the new one,
never half of one, readable by its owner alone: mode 0600, as it may hold a
secret) and read once at start.  What goes in it is its callers' business
(``Membership.snapshot``, ``CheckpointCoordinator.snapshot``, the store's
port, the shard credential the server made); the rule of what is durable is
in docs/fault-tolerance.md.
"""

import json
import logging
import os
import pathlib
import threading
from typing import Any, Callable, Dict, Optional

logger = logging.getLogger(__name__)

JOURNAL_NAME = "coordinator.json"
#: The journal's format; a journal of another is refused at start, naming it.
JOURNAL_VERSION = 1
#: The journal's file mode: its owner's alone.
JOURNAL_MODE = 0o600
#: How often the writer looks for a change to write.
WRITE_EVERY_S = 0.1


class JournalError(OSError):
    """The journal cannot be read or made; ``str()`` says which file and why (ps-server says it and exits 1)."""


class Journal:
    """The journal in ``directory`` (made if missing)."""

    def __init__(self, directory: str):
        self.directory = pathlib.Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise JournalError(f"--state-dir {directory}: cannot make it: {error.strerror or error}") from None
        self.path = self.directory / JOURNAL_NAME
        self._written: Optional[str] = None
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def read(self) -> Optional[Dict[str, Any]]:
        """The journal written before, or ``None`` when there is none (a cluster's first start)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise JournalError(f"cannot read {self.path}: {error.strerror or error}") from None
        try:
            state = json.loads(text)
        except json.JSONDecodeError as error:
            raise JournalError(f"{self.path} is not JSON ({error}); move it away to start a new cluster") from None
        if not isinstance(state, dict) or state.get("version") != JOURNAL_VERSION:
            raise JournalError(f"{self.path} is not a journal of version {JOURNAL_VERSION}; move it away to start "
                               "a new cluster")
        self._written = text
        return state

    def write(self, state: Dict[str, Any]) -> bool:
        """Write ``state`` if it differs from what was written last; True when it was written."""
        text = json.dumps(dict(state, version=JOURNAL_VERSION), sort_keys=True)
        if text == self._written:
            return False
        temporary = self.path.with_name(f".{JOURNAL_NAME}.{os.getpid()}")
        # Readable by its owner alone: it may hold the shard credential the server made.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, JOURNAL_MODE)
        os.fchmod(descriptor, JOURNAL_MODE)  # (a temporary file left by an earlier process keeps its mode)
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)
        self._written = text
        return True

    def keep_writing(self, state: Callable[[], Dict[str, Any]]) -> "Journal":
        """From now on, write ``state()`` whenever it changes (looked at every ``WRITE_EVERY_S``) until
        ``stop()``, which writes it a last time."""
        self._state = state
        self._thread = threading.Thread(target=self._run, name="journal", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        failing = False
        while True:
            stopped = self._stopped.wait(WRITE_EVERY_S)
            try:
                self.write(self._state())
                if failing:
                    logger.warning("the journal %s is written again", self.path)
                failing = False
            except OSError as error:
                if not failing:  # once, until it works again
                    logger.error("cannot write the journal %s: %s", self.path, error)
                failing = True
            if stopped:
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(5)
