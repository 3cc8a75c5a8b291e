"""A worker's row cache: the rows of several steps read in one lookup, each step's served from there.

Owns ``RowWindow``: the steps of a window (consecutive steps whose batches
are known), their ids routed once per step, the union of those ids per
table and row range (what one lookup per shard asks), and, once that
lookup's rows are back, each step's rows taken from them
(``RowWindow.lookup(step)``: a ``CollectionLookup`` that pools and pushes
like one sent for that step alone).  A row several steps of a window need
crosses the wire once: those are the cache's hits.  Which steps make a
window, when it is read and when it is dropped is the worker's pipeline's
business (``paramserver.train.pipeline``), under the staleness bound: rows
read once serve steps that run later, so a window never spans more steps
than the staleness allows.  Its size is bounded in rows (``max_rows``),
in bytes of rows (``max_bytes``), in rows per table (``max_table_rows``),
or any of those together: the longest run of the steps offered whose union
fits, at least one step (a step's own rows are read whatever their
number).
"""

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...tables import DistinctIds
from .collection import CollectionLookup, EmbeddingCollection, LookupPlan
from .embedding import Route


class RowWindow:
    """The steps ``steps`` (``(step, features)`` pairs, consecutive) of ``collection``, read as one lookup:
    the longest leading run of them whose distinct rows, over every table, are at most ``max_rows`` and take
    at most ``max_bytes``, and whose rows of table ``name`` are at most ``max_table_rows[name]`` (``None``,
    or a table not named: no bound; the first step always).  ``distinct``: per step, the distinct
    ids of its tables found already (``paramserver.tables.distinct_ids``), so that routing them does not
    find them again.  ``plan`` is that lookup, not sent: send it (on its own with
    ``collection.lookup_planned``, or carried by a push) and hand the sent lookup to ``read``."""

    def __init__(self, collection: EmbeddingCollection, steps: Sequence[Tuple[int, Mapping[str, Tensor]]],
                 max_rows: Optional[int] = None, distinct: Optional[Mapping[int, Mapping[str, DistinctIds]]] = None,
                 max_bytes: Optional[int] = None, max_table_rows: Optional[Mapping[str, int]] = None):
        if not steps:
            raise ValueError("a row window needs at least one step")
        self.collection = collection
        self._routes: Dict[int, Dict[str, Route]] = {}
        # Per table and row range: the distinct ids of each step taken so far.  Their union is taken once, at
        # the end; the bound takes it sooner only when their sizes summed (its most) exceed it.
        taken: Dict[Tuple[str, int], List[Tensor]] = {}
        self.rows_needed = bytes_needed = 0  # each step's distinct rows, summed: what it would read alone

        def over(grown: Mapping[Tuple[str, int], List[Tensor]], rows_of: Callable[[List[Tensor]], int]) -> bool:
            rows = {key: rows_of(held) for key, held in grown.items()}
            if max_table_rows and any(sum(count for (name, _), count in rows.items() if name == table) > most
                                      for table, most in max_table_rows.items()):
                return True
            return (max_rows is not None and sum(rows.values()) > max_rows) or \
                (max_bytes is not None and sum(count * collection.tables[name].row_bytes
                                               for (name, _), count in rows.items()) > max_bytes)

        for step, features in steps:
            found = (distinct or {}).get(step, {})
            routes = {name: table.route(features[name], distinct=found.get(name))
                      for name, table in collection.tables.items()}
            if self._routes and (max_rows is not None or max_bytes is not None or max_table_rows):
                grown = {key: list(held) for key, held in taken.items()}
                for name, route in routes.items():
                    for range_index, local_ids in route.requests:
                        grown.setdefault((name, range_index), []).append(local_ids)
                if over(grown, lambda held: sum(piece.numel() for piece in held)) and \
                        over(grown, lambda held: _union(held).numel()):
                    break
            self._routes[step] = routes
            for name, route in routes.items():
                for range_index, local_ids in route.requests:
                    taken.setdefault((name, range_index), []).append(local_ids)
                rows = sum(local_ids.numel() for _, local_ids in route.requests)
                self.rows_needed += rows
                bytes_needed += rows * collection.tables[name].row_bytes
        union = {key: _union(held) for key, held in taken.items()}
        #: The steps it serves, in order.
        self.steps: List[int] = list(self._routes)
        #: Distinct rows it reads (and holds once read).
        self.rows_held = sum(ids.numel() for ids in union.values())
        #: Bytes of rows its steps need that cross the wire once instead of once per step.
        self.bytes_saved = bytes_needed - sum(ids.numel() * collection.tables[name].row_bytes
                                              for (name, _), ids in union.items())
        self._union = union
        # One step: its own routes are the lookup's, and the lookup is the step's (as if sent for it alone).
        self._single = len(self.steps) == 1
        # Per table, its row ranges' distinct ids in range order (what the lookup asks), and where each range's
        # rows start among the table's rows the lookup returns.
        requests: Dict[str, List[Tuple[int, Tensor]]] = {name: [] for name in collection.tables}
        self._starts: Dict[Tuple[str, int], int] = {}
        if not self._single:
            for (name, range_index), ids in sorted(union.items(), key=lambda item: item[0]):
                self._starts[(name, range_index)] = sum(held.numel() for _, held in requests[name])
                requests[name].append((range_index, ids))
        self.plan: LookupPlan = collection.plan_routes(
            self._routes[self.steps[0]] if self._single else
            {name: Route(collection.tables[name], torch.empty(0, dtype=torch.long), pieces)
             for name, pieces in requests.items()}, self.steps[0])
        self._read: Optional[CollectionLookup] = None
        self._rows: Optional[Dict[str, Tensor]] = None

    @property
    def table_rows_held(self) -> Dict[str, int]:
        """Distinct rows it reads (and holds once read) per table."""
        held = {name: 0 for name in self.collection.tables}
        for (name, _), ids in self._union.items():
            held[name] += ids.numel()
        return held

    @property
    def row_hits(self) -> int:
        """Rows its steps need that a step before them in the window read already (they cross the wire once)."""
        return self.rows_needed - self.rows_held

    def read(self, lookup: CollectionLookup) -> "RowWindow":
        """``plan``'s lookup, sent."""
        self._read = lookup
        return self

    def lookup(self, step: int) -> CollectionLookup:
        """Step ``step``'s lookup, its rows taken from the window's (waits for them the first time;
        ``ShardRequestFailed`` when the read failed)."""
        if self._read is None:
            raise RuntimeError(f"the row window of steps {self.steps} was not read")
        if self._single:
            return self._read
        if self._rows is None:
            self._rows = self._read.unique_rows()
        routes, rows = self._routes[step], {}
        for name, route in routes.items():
            positions = [self._positions(name, range_index, local_ids) for range_index, local_ids in route.requests]
            rows[name] = self._rows[name].index_select(0, positions[0] if len(positions) == 1 else
                                                       torch.cat(positions)) if positions else \
                self.collection.tables[name].no_rows(False)
        return CachedLookup(self.collection, routes, rows, step)

    def _positions(self, name: str, range_index: int, local_ids: Tensor) -> Tensor:
        """Where ``local_ids`` (of row range ``range_index`` of table ``name``) are among the table's rows read."""
        positions = torch.searchsorted(self._union[(name, range_index)], local_ids)
        start = self._starts[(name, range_index)]
        return positions + start if start else positions


class CachedLookup(CollectionLookup):
    """A step's lookup whose rows were read already (a ``RowWindow``'s): it pools and pushes like any."""

    def __init__(self, collection: EmbeddingCollection, routes: Dict[str, Route], rows: Dict[str, Tensor],
                 step: int):
        super().__init__(collection, routes, {}, {}, step)
        self._cached = rows

    def unique_rows(self) -> Dict[str, Tensor]:
        return self._cached


def _union(pieces: Sequence[Tensor]) -> Tensor:
    """The sorted distinct ids of ``pieces`` (each sorted and distinct: one piece is its own union)."""
    return pieces[0] if len(pieces) == 1 else torch.unique(torch.cat(pieces))
