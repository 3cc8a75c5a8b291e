"""The trainers' part of a checkpoint: its format, writing it and reading it back.

Owns the file trainer group 0's rank 0 writes into a checkpoint
(``dense.pt``, format ``FORMAT``): the step, the dense replica's
``state_dict`` and its optimizer's, the comm hook with its options and
every member's pickled hook state (in rank order), every worker's data
position (``{"used": batches, "state": the data's state or None}``),
the members' RPC names, and the model's description (``model``, for an
export).  ``read_dense_part`` loads it from a committed checkpoint,
checked against the manifest; a restore (``paramserver.train.checkpoints``)
and an export (``export``) read it through it.

It knows nothing of processes, collectives or RPC: when the part is
written, and by whom, is ``paramserver.train.checkpoints``'s business.
"""

from typing import Any, Dict, List, Optional

from ..filesystems import locate
from .storage import Checkpoint, CorruptCheckpoint, FileRecord, PathLike, load_tensors, save_tensors

DENSE_PART = "dense.pt"
#: 3: ``"model"`` describes the model (``model.describe_model``; ``None`` when not given).  2: data positions
#: are ``{"used": batches, "state": the data's state or None}`` (1: a step count).
FORMAT = 3


def write_dense_part(directory: PathLike, *, step: int, module: Dict[str, Any], optimizer: Dict[str, Any],
                     hook: str, hook_options: Dict[str, Any], hook_states: List[bytes],
                     data_positions: Dict[int, Any], members: List[str],
                     model: Optional[Dict[str, Any]]) -> FileRecord:
    """Write ``directory``'s dense part atomically (a path, URL or ``Location``); returns its record."""
    return save_tensors(locate(directory).join(DENSE_PART), {
        "format": FORMAT, "step": step, "module": module, "optimizer": optimizer, "hook": hook,
        "hook_options": hook_options, "hook_states": hook_states, "data_positions": data_positions,
        "members": members, "model": model})


def read_dense_part(checkpoint: Checkpoint) -> Dict[str, Any]:
    """``checkpoint``'s dense part, checked against its manifest (``CorruptCheckpoint`` naming the file).

    ``{"step", "module", "optimizer", "hook", "hook_states", "data_positions", "model", ...}``;
    ``hook_states`` are pickled per rank of the group that wrote it.
    """
    record = next((f for f in checkpoint.files if f.name == DENSE_PART), None)
    if record is None:
        raise CorruptCheckpoint(f"{checkpoint.path}: no {DENSE_PART} in its manifest")
    return load_tensors(checkpoint.file(DENSE_PART), record)
