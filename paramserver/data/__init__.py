"""Input from files: Criteo-format text and Parquet, read by each worker in its own share, resumable.

``FileReader`` is the iterable of ``paramserver.Batch`` a Trainer reads
(``reader``); ``criteo`` and ``parquet`` own the two formats, ``parts``
which files and bytes each worker reads, ``errors`` what goes wrong.
"""

from .criteo import CATEGORICAL, DENSE, MISSING_ID
from .errors import MalformedInput, UnreadableFile
from .parquet import ParquetSchema
from .reader import FileReader, reader_from_config

__all__ = ["CATEGORICAL", "DENSE", "FileReader", "MalformedInput", "MISSING_ID", "ParquetSchema",
           "UnreadableFile", "reader_from_config"]
