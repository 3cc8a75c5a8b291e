"""The records checkpoints are exchanged in: where they are kept, a written one, a failed one.

Owns ``CheckpointSettings`` (where the cluster keeps checkpoints and
where a run starts from, as a job's ``JobContext`` hands them out),
``CheckpointCommit`` (a written checkpoint, handed to the coordinator to
commit) and ``CheckpointFailure`` (one that could not be written).  They
are plain frozen dataclasses: no protobuf message is imported here
(``CheckpointSettings.from_message`` reads any object with its fields),
and nothing here writes, sends or decides anything.
"""

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple

from ..filesystems import Location, locate


@dataclass(frozen=True)
class CheckpointSettings:
    """Where the cluster keeps checkpoints (``directory`` empty: none) and where this run starts from.

    ``directory`` and ``restore_from`` are paths or fsspec URLs; ``storage_options`` are the options of their
    filesystem (``ps-server --storage-options``), for whoever writes or reads there (``locate``).
    """

    directory: str = ""
    every_steps: int = 0
    restore_from: str = ""
    restore_step: int = 0
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    #: Tables whose rows the checkpoint holds in another type are restored converted (``ps-server
    #: --convert-rows``), not refused.
    convert_rows: bool = False

    def locate(self, name: str) -> Location:
        """``name`` (``directory``, ``restore_from`` or one below them) on the checkpoints' filesystem."""
        return locate(name, self.storage_options)

    @classmethod
    def from_message(cls, settings) -> "CheckpointSettings":
        options = getattr(settings, "storage_options_json", "")
        return cls(directory=settings.directory, every_steps=int(settings.every_steps),
                   restore_from=settings.restore_from, restore_step=int(settings.restore_step),
                   storage_options=json.loads(options) if options else {},
                   convert_rows=bool(getattr(settings, "convert_rows", False)))


@dataclass(frozen=True)
class LiveExportSettings:
    """Where trainer group 0 writes live exports (``directory`` empty: none; ``ps-server --export-dir``),
    every ``every_steps`` steps, every ``base_every``-th a base; ``storage_options`` for its filesystem;
    ``keep``: the newest bases kept with their deltas (``--keep-exports``; 0: every export stays)."""

    directory: str = ""
    every_steps: int = 100
    base_every: int = 24
    keep: int = 0
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_message(cls, settings) -> "LiveExportSettings":
        options = settings.storage_options_json
        return cls(directory=settings.directory, every_steps=int(settings.every_steps) or 100,
                   base_every=int(settings.base_every) or 24, storage_options=json.loads(options) if options else {},
                   keep=int(getattr(settings, "keep", 0)))


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
