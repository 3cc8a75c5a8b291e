"""Who reads which part of a followed input: merging readers' positions into one and dealing it to a group.

Owns the rule, and nothing else (no processes, no I/O: ``paramserver.train.shares`` runs it in a trainer
group).  A followed input's position (``reader.FileReader.state_dict()``) names parts by key: ``done``
(parts that reader must not start: read whole, or under way at another reader when it was dealt), and the
parts under way: ``key`` with ``offset`` and ``rows`` (the part being read), and ``held`` (more of them,
each ``(key, offset, rows)``, read after it).

``deal(members, others, size, take)``: the positions of a group of ``size`` members, from ``members``
(rank ``r``'s position now; ``None`` for a member that brings nothing, one that joined) and ``others``
(positions of readers that are no member: those of members that left, replayed up to the group's step, or a
checkpoint's, whatever workers wrote them); ``take`` (part key -> bool; ``None``: every part) says which
parts under way in ``others`` the group may read on (several groups reading one input:
``paramserver.train.claims``); the others are left out of the deal, neither under way nor done:

* a part is done if some position has it done and none has it under way (a reader's ``done`` also holds the
  parts under way elsewhere when it was dealt: under way wins);
* each member keeps its parts under way; a part under way in ``others`` goes to member
  ``crc32(key) % size``; a part under way twice (positions of different moments) is taken from where it is
  furthest on;
* every other part not done is read by member ``crc32(key) % size`` (``FileReader``'s rule for its own
  parts), from its start;
* ``done_below`` (every part whose key sorts below it is done: its file is older than every file a listing
  found) is the highest of the positions', and the parts done below it are left out of ``done``.

So over the group's members every line not read yet is read once, and none already read is read again.
``again(before, after)``: a position that reads a batch again whatever the deal (its parts kept).
"""

import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: A part under way: (key, chunk offset, rows of that chunk given).
UnderWay = Tuple[str, int, int]


def under_way(state: Dict[str, Any]) -> List[UnderWay]:
    """A followed input's position's parts under way, in the order they are read."""
    first = [(str(state["key"]), int(state.get("offset", 0)), int(state.get("rows", 0)))] if state.get("key") else []
    return first + [(str(key), int(offset), int(rows)) for key, offset, rows in state.get("held", ())]


def owner(key: str, size: int) -> int:
    """The member of ``size`` who reads part ``key`` when no member has it under way."""
    return zlib.crc32(key.encode()) % size


def is_followed(state: Any) -> bool:
    """Whether ``state`` is a followed input's position (named parts), not a fixed input's or another data's."""
    return isinstance(state, dict) and "done" in state


def again(before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    """The position ``before`` a batch, with the parts that batch began (done or under way in the position
    ``after`` it, neither in ``before``) held from their start, in the order it read them: a reader dealt it
    reads the same batch again (a step redone after its group re-formed trains the lines it tried)."""
    known = set(before["done"]) | {key for key, _, _ in under_way(before)}
    begun = [key for key in after["done"] if key not in known]
    begun += [key for key, _, _ in under_way(after) if key not in known and key not in begun]
    if not begun:
        return before
    return dict(before, held=tuple(before.get("held", ())) + tuple((key, 0, 0) for key in begun))


def deal(members: Sequence[Optional[Dict[str, Any]]], others: Sequence[Dict[str, Any]],
         size: Optional[int] = None, take: Optional[Callable[[str], bool]] = None) -> List[Dict[str, Any]]:
    """Each member's position (see the module's text); ``size`` defaults to ``len(members)``."""
    size = len(members) if size is None else size
    if size < 1 or len(members) > size:
        raise ValueError(f"a group of {size} cannot hold {len(members)} members")
    states = [state for state in members if state is not None] + list(others)
    for state in states:
        if not is_followed(state):
            raise ValueError(f"not a followed input's position (its parts named): {state!r}")
    # (progress, order of precedence: members first by rank, then others) -> who reads a part under way
    takers: Dict[str, Tuple[Tuple[int, int], int, UnderWay, int]] = {}
    sources = [(rank, state) for rank, state in enumerate(members) if state is not None] + \
              [(None, state) for state in others]
    left: set = set()  # parts under way in ``others`` that ``take`` refused: another group's
    for order, (rank, state) in enumerate(sources):
        for part in under_way(state):
            key, offset, rows = part
            if rank is None and take is not None and key not in takers and (key in left or not take(key)):
                left.add(key)
                continue
            taker = rank if rank is not None else owner(key, size)
            best = takers.get(key)
            if best is None or (offset, rows) > best[0]:
                takers[key] = ((offset, rows), order, part, taker)
    done_below = max((str(state.get("done_below", "")) for state in states), default="")
    done = {key for key in set().union(*(state["done"] for state in states)) - set(takers) - left
            if key >= done_below}
    dealt = []
    for rank in range(size):
        mine = [entry[2] for entry in sorted(takers.values(), key=lambda entry: entry[1]) if entry[3] == rank]
        own = members[rank] if rank < len(members) else None
        first = mine[0] if mine else ("", 0, 0)
        dealt.append({"epoch": 0, "part": 0, "offset": first[1], "rows": first[2],
                      "malformed": int(own.get("malformed", 0)) if own is not None else 0,
                      "done": tuple(sorted(done | {key for key, entry in takers.items() if entry[3] != rank})),
                      "key": first[0], "held": tuple(mine[1:]), "done_below": done_below})
    return dealt
