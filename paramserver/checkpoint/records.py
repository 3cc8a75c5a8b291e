"""The records checkpoints are exchanged in: where they are kept, a written one, a failed one.

Owns ``CheckpointSettings`` (where the cluster keeps checkpoints and
where a run starts from, as a job's ``JobContext`` hands them out),
``CheckpointCommit`` (a written checkpoint, handed to the coordinator to
commit) and ``CheckpointFailure`` (one that could not be written).  They
are plain frozen dataclasses: no protobuf message is imported here
(``CheckpointSettings.from_message`` reads any object with its fields),
and nothing here writes, sends or decides anything.
"""

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class CheckpointSettings:
    """Where the cluster keeps checkpoints (``directory`` empty: none) and where this run starts from."""

    directory: str = ""
    every_steps: int = 0
    restore_from: str = ""
    restore_step: int = 0

    @classmethod
    def from_message(cls, settings) -> "CheckpointSettings":
        return cls(directory=settings.directory, every_steps=int(settings.every_steps),
                   restore_from=settings.restore_from, restore_step=int(settings.restore_step))


@dataclass(frozen=True)
class CheckpointCommit:
    """A written checkpoint, handed to the coordinator to verify and commit (it writes the manifest).

    ``files``: ``{"name", "bytes", "sha256"}`` records; ``request``: the
    checkpoint request it answers (0: written by steps).
    """

    request: int
    directory: str
    step: int
    files: Tuple[Dict, ...]
    info: Dict


@dataclass(frozen=True)
class CheckpointFailure:
    """A checkpoint that could not be written, reported to the coordinator: it fails the request (a waiting
    ``ps-ctl checkpoint`` hears ``reason`` at once) and removes ``directory``'s parts ("" when none)."""

    request: int
    directory: str
    step: int
    reason: str
