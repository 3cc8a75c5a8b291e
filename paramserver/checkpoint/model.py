"""The model's description in a checkpoint's dense part: enough to rebuild the model without the job.

Owns the description a Trainer records with every checkpoint (under
``"model"`` in ``dense.pt``), both ways: ``describe_model`` writes it as
plain data (loadable with ``torch.load(weights_only=True)``), and
``ModelDescription.from_dense_part`` reads it back for an export.  It
holds every field of each table (``paramserver.Table``), the prefix
naming the tables on the shards, and the dense module's class
(``module:qualname``) with its constructor's keyword arguments.

The dense module's side is one method: a module that can be rebuilt
defines ``export_kwargs()``, returning JSON-able keyword arguments such
that ``type(module)(**module.export_kwargs())`` builds it again (its
weights aside).  A module without it is described by its class alone:
its weights still export, and loading the export needs a module given.

It knows nothing of shards, files or the Trainer's loop.
"""

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn

#: The method a dense module defines to be rebuilt from an export.
EXPORT_KWARGS = "export_kwargs"
#: The description's own format (in the dense part, under ``"model"``).
MODEL_FORMAT = 1


class NotExportable(ValueError):
    """A checkpoint that cannot be exported as it is: written without a model description (before
    paramserver recorded one), or lacking the rows of a table it describes; the message names the checkpoint
    and what is missing."""


def class_reference(cls: type) -> str:
    """``module:qualname``, how an export names a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def describe_model(prefix: str, tables: Mapping[str, Any], dense: nn.Module) -> Dict[str, Any]:
    """The description of a Trainer's model: ``tables`` (``paramserver.Table``s, by name) named
    ``<prefix>.<name>`` on the shards, and ``dense``.  ``TypeError`` naming the class when its
    ``export_kwargs()`` is not a dict of JSON-able values."""
    kwargs_json = None
    export_kwargs = getattr(dense, EXPORT_KWARGS, None)
    if export_kwargs is not None:
        kwargs = export_kwargs()
        if not isinstance(kwargs, dict):
            raise TypeError(f"{class_reference(type(dense))}.{EXPORT_KWARGS}() must return a dict of keyword "
                            f"arguments, got {type(kwargs).__name__}")
        try:
            kwargs_json = json.dumps(kwargs)
        except (TypeError, ValueError) as error:
            raise TypeError(f"{class_reference(type(dense))}.{EXPORT_KWARGS}() must return JSON-able values: "
                            f"{error}") from error
    return {"format": MODEL_FORMAT, "prefix": prefix,
            "tables": {name: _described_table(table) for name, table in tables.items()},
            "dense": {"class": class_reference(type(dense)), "kwargs_json": kwargs_json}}


def _described_table(table: Any) -> Dict[str, Any]:
    """A ``Table``'s fields as JSON values (its row type by name: ``"float16"``)."""
    described = dataclasses.asdict(table)
    described["dtype"] = dtype_name(table.dtype)
    return described


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``: how descriptions and manifests name a row type."""
    return str(dtype).rsplit(".", 1)[-1]


def named_dtype(name: str) -> torch.dtype:
    """The row type ``dtype_name`` named (also as ``"torch.float16"``; ``ValueError`` for another name)."""
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype


@dataclass(frozen=True)
class TableShape:
    """What an export needs of one table: its size (``None``: a dynamic table), row width, pooling and the type
    its rows are stored in (float32 in descriptions written before tables had one)."""

    num_embeddings: Optional[int]
    embedding_dim: int
    mode: str
    dtype: torch.dtype = torch.float32

    @property
    def dynamic(self) -> bool:
        return self.num_embeddings is None


@dataclass(frozen=True)
class ModelDescription:
    """A checkpoint's description of its model, read back (``describe_model`` wrote it)."""

    prefix: str
    tables: Dict[str, TableShape]
    dense_class: str
    #: The dense module's keyword arguments; ``None`` when it has no ``export_kwargs()``.
    dense_kwargs: Optional[Dict[str, Any]]

    def shard_name(self, table: str) -> str:
        """How table ``table`` is named on the shards and in their checkpoint parts."""
        return f"{self.prefix}.{table}"

    @classmethod
    def from_dense_part(cls, part: Mapping[str, Any], where: str) -> "ModelDescription":
        """The description in dense part ``part`` of the checkpoint ``where``; ``NotExportable`` naming it when
        there is none or it cannot be read."""
        model = part.get("model")
        if model is None:
            raise NotExportable(f"checkpoint {where} was written without a model description (dense part format "
                                f"{part.get('format', 1)}, before the Trainer recorded one): it cannot be exported; "
                                "a checkpoint written by this version can")
        try:
            if model["format"] != MODEL_FORMAT:
                raise ValueError(f"format {model['format']}, this version reads {MODEL_FORMAT}")
            tables = {str(name): TableShape(None if table["num_embeddings"] is None else int(table["num_embeddings"]),
                                            int(table["embedding_dim"]), str(table["mode"]),
                                            named_dtype(str(table.get("dtype", "float32"))))
                      for name, table in model["tables"].items()}
            kwargs_json = model["dense"]["kwargs_json"]
            return cls(prefix=str(model["prefix"]), tables=tables, dense_class=str(model["dense"]["class"]),
                       dense_kwargs=None if kwargs_json is None else json.loads(kwargs_json))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise NotExportable(f"checkpoint {where}: its model description cannot be read: "
                                f"{type(error).__name__}: {error}") from None
