"""The dynamic-table engine of a shard: rows for any int64 id, made, kept and dropped here.

``rows.DynamicRows`` (one shard's part of a table), ``id_index`` (where
ids are), ``admission`` (when an id gets a row), ``huge_pages`` (large
tensors on huge pages), ``native`` (the C kernel of lookups, ``kernel.c``).
The options and the hashes every side agrees on are ``paramserver.tables``'.
"""

from .rows import DynamicRows

__all__ = ["DynamicRows"]
