"""The one row-sparse driver every functional optimizer runs on: per-row state, and a step's rows.

Owns the two halves of the row-state protocol (docs/optimizers.md, "Adding an optimizer"), which every
functional optimizer of ``paramserver.optim`` plugs its math into:

* ``RowState``: an optimizer's state per parameter, made on the parameter's first gradient from a
  declaration (names, layouts, initial values), kept so that its rows follow the parameter's rows: a
  dynamic table's slab that grows (``resize_rows``) or whose slot gets a new id (``reset_rows``) gets
  new state rows at their initial values (Adagrad's ``initial_accumulator_value``, FTRL's 0.1, not
  zeros); ``state_dict`` / ``load_state_dict`` checked against each layout.
* ``RowStep``: one step's gradients made ready for the optimizer's math: dense gradients with their
  parameters and state whole; row-sparse ones (COO, one index per row, duplicates summed) as the
  touched rows of parameter, gradient and state, gathered once, and written back by ``scatter()``.
  What a step changes once whatever its rows (the state made, the rounding step counted:
  ``RowState.begin_step``) is done before, so that runs of one step's rows may be stepped at once, each
  writing only its own rows.

Layouts of a state tensor: ``"element"`` (shaped like its parameter), ``"row"`` (one value per row of a
2-D parameter, as FBGEMM's row-wise optimizers keep; shaped like the parameter otherwise), ``"scalar"``
(one value per parameter, such as a step count: never gathered), ``"row_flag"`` (one bool per row,
``False`` at first; a state dict without it loads as all ``True``).
State lists are kind-major: ``state[k][j]`` is kind ``k`` of the ``j``-th parameter of a list, so that
an optimizer's math is a handful of multi-tensor operations over each list.

Half-precision parameters (float16 or bfloat16 rows, ``tables.row_types.is_half``) are updated in float32: their
state is float32, a step gathers their touched rows as float32 copies (a dense gradient of such a parameter
touches every row), the optimizer's math runs on those, and ``scatter()`` writes them back rounded
(``rounding.round_rows``): stochastically by default, with bits hashed from the parameter's table key
(``RowState.set_rounding``), the step's number and each value's row id and column, or to nearest.  A row's
id is its place in its table: the parameter's row plus the first row of the table the parameter holds
(a part of a table cut by rows), or read from a tensor of ids by row (a dynamic table's slots), so rows get
the same bits whichever part of a step writes them.  Gradients may come in float32 or in the parameter's
own type; they are read as float32.

Everything compiles under TorchScript (where a script class uses it) and runs as plain Python too: with
TorchScript off the same classes step eagerly, with the same operations, so the same rows.  It owns no
optimizer math.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .kernels import sparse_rows
from ..tables.row_types import is_half
from .rounding import round_rows, stream_seed


def check_layout(optimizer: str, name: str, layout: str) -> None:
    """``ValueError`` unless ``layout`` is one ``RowState`` knows."""
    if layout != "element" and layout != "row" and layout != "scalar" and layout != "row_flag":
        raise ValueError("{}: state '{}' has layout '{}'; expected 'element', 'row', 'scalar' or 'row_flag'".format(
            optimizer, name, layout))


def state_shape(layout: str, param: Tensor) -> List[int]:
    """The shape a state tensor of ``layout`` has for ``param``."""
    if layout == "scalar" or param.dim() == 0:
        return []
    if layout == "row_flag" or (layout == "row" and param.dim() == 2):
        return [param.size(0)]
    return list(param.shape)


def state_dtype(param: Tensor) -> torch.dtype:
    """The type of ``param``'s state and of the values its update is computed in: float32 for a half-precision
    parameter, its own type otherwise."""
    if is_half(param.dtype):
        return torch.float32
    return param.dtype


class RowState:
    """The state ``optimizer`` keeps for each of ``params``: kinds ``names``, of ``layouts``, starting at
    ``initial`` (made on a parameter's first step; ``tensors[i]`` is ``None`` until then)."""

    def __init__(self, optimizer: str, params: List[Tensor], names: List[str], layouts: List[str],
                 initial: List[float]):
        if len(layouts) != len(names) or len(initial) != len(names):
            raise ValueError("{}: {} state names, {} layouts and {} initial values; the lengths must be equal".format(
                optimizer, len(names), len(layouts), len(initial)))
        for k in range(len(names)):
            check_layout(optimizer, names[k], layouts[k])
        self.optimizer = optimizer
        self.params = params
        self.names = names
        self.layouts = layouts
        self.initial = initial
        self.tensors: List[Optional[List[Tensor]]] = [None for _ in params]
        #: Per parameter, how its half-precision rows are rounded (``set_rounding``) and how many steps wrote
        #: them (each step rounds with bits of its own).
        self.rounding_keys: List[int] = [0 for _ in params]
        self.rounds_nearest: List[bool] = [False for _ in params]
        self.rounding_first_rows: List[int] = [0 for _ in params]
        self.rounding_ids: List[Optional[Tensor]] = [None for _ in params]
        self.rounding_steps: List[int] = [0 for _ in params]

    def set_rounding(self, i: int, key: int, nearest: bool, first_row: int = 0,
                     ids: Optional[Tensor] = None) -> None:
        """Parameter ``i``'s rows (if half-precision) are written back to nearest (``nearest``) or stochastically
        with bits hashed from ``key`` (its table's, a 32-bit word; 0 by default), the step's number and each
        value's row id and column: row ``r``'s id is ``ids[r]`` (int64, one per row; a tensor that may grow in
        place with the parameter) when given, else ``first_row + r``."""
        self.rounding_keys[i] = key
        self.rounds_nearest[i] = nearest
        self.rounding_first_rows[i] = first_row
        self.rounding_ids[i] = ids

    def begin_step(self, gradients: List[Optional[Tensor]]) -> None:
        """What a step changes once, whatever rows it has: each parameter with a gradient has its state made
        (at its initial values, if it had none) and counts one more rounding step.  Done before a step's rows
        (``RowStep``), which then only read the state's bookkeeping, so that runs of one step's rows may be
        stepped at once."""
        for i in range(len(self.params)):
            if gradients[i] is not None:
                self.of(i)
                self.rounding_steps[i] += 1

    def count_table_step(self, gradients: List[Optional[Tensor]], k: int) -> None:
        """Each parameter with a gradient adds one to its state tensor ``k``, a step count of the whole table
        (not a row's: a gradient without rows counts too, as torch's Adagrad and SparseAdam count it).  Part of
        a step's once-work (``prepare_step``), before its rows."""
        for i in range(len(self.params)):
            if gradients[i] is not None:
                self.of(i)[k].add_(1)

    def rounded(self, i: int, values: Tensor, rows: Tensor) -> Tensor:
        """``values`` (rows ``rows`` of parameter ``i``, computed in float32) in the parameter's type, rounded as
        ``set_rounding`` said, with this step's (``begin_step``) bits for those rows' ids."""
        dtype = self.params[i].dtype
        if not is_half(dtype):
            return values
        ids = self.rounding_ids[i]
        row_ids = rows + self.rounding_first_rows[i] if ids is None else ids.index_select(0, rows)
        return round_rows(values, dtype, self.rounds_nearest[i],
                          stream_seed(self.rounding_keys[i], self.rounding_steps[i]), row_ids)

    def _new(self, k: int, param: Tensor) -> Tensor:
        shape = state_shape(self.layouts[k], param)
        if self.layouts[k] == "row_flag":
            return torch.zeros(shape, dtype=torch.bool, device=param.device)
        if self.layouts[k] == "element" and not is_half(param.dtype):
            return torch.full_like(param, self.initial[k], memory_format=torch.preserve_format)
        return torch.full(shape, self.initial[k], dtype=state_dtype(param), device=param.device)

    def of(self, i: int) -> List[Tensor]:
        """Parameter ``i``'s state tensors (one per kind), made at their initial values if it had none."""
        made = self.tensors[i]
        if made is None:
            created: List[Tensor] = []
            for k in range(len(self.names)):
                created.append(self._new(k, self.params[i]))
            self.tensors[i] = created
            return created
        return made

    def has(self, i: int) -> bool:
        return self.tensors[i] is not None

    def resize_rows(self, i: int, rows: int) -> None:
        """Parameter ``i`` grew in place to ``rows`` rows (a dynamic table's slab): so does its state; new rows
        start at their initial values."""
        made = self.tensors[i]
        if made is not None:
            for k in range(len(made)):
                if self.layouts[k] != "scalar":
                    state = made[k]
                    old = state.size(0)
                    shape = state.size()
                    state.resize_([rows] + list(shape[1:]))
                    if rows > old:
                        state.narrow(0, old, rows - old).fill_(self.initial[k])

    def reset_rows(self, i: int, rows: Tensor) -> None:
        """Rows ``rows`` of parameter ``i`` start afresh (a new id took them): their state is at its initial
        values."""
        made = self.tensors[i]
        if made is not None:
            for k in range(len(made)):
                if self.layouts[k] != "scalar":
                    made[k].index_fill_(0, rows, self.initial[k])

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        """``{param index: {name: tensor}}`` (copies); parameters that never had a gradient have no entry.  A
        half-precision parameter's entry with state also holds ``"rounding_step"`` (a 0-d int64): the steps that
        rounded it, so that one restored from it rounds on with new bits (``load_state_dict``)."""
        state: Dict[int, Dict[str, Tensor]] = {}
        for i in range(len(self.params)):
            made = self.tensors[i]
            if made is not None:
                entry: Dict[str, Tensor] = {}
                for k in range(len(made)):
                    entry[self.names[k]] = made[k].clone()
                if len(made) > 0 and is_half(self.params[i].dtype):
                    entry["rounding_step"] = torch.tensor(self.rounding_steps[i], dtype=torch.int64)
                state[i] = entry
        return state

    def check_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """``ValueError`` naming the first entry of ``state`` that does not fit (index, name, shape)."""
        for i, entry in state.items():
            if i < 0 or i >= len(self.params):
                raise ValueError("{}.load_state_dict: parameter index {} out of range for {} parameters".format(
                    self.optimizer, i, len(self.params)))
            for k in range(len(self.names)):
                name = self.names[k]
                if name not in entry and self.layouts[k] == "row_flag":
                    continue  # saved without flags: every row had its first step
                if name not in entry:
                    raise ValueError("{}.load_state_dict: entry {} has no '{}'".format(self.optimizer, i, name))
                expected = state_shape(self.layouts[k], self.params[i])
                if list(entry[name].shape) != expected:
                    raise ValueError("{}.load_state_dict: {} {} has shape {} but parameter {} has shape {} (its "
                                     "'{}' state: {})".format(self.optimizer, name, i, list(entry[name].shape), i,
                                                              list(self.params[i].shape), self.layouts[k], expected))
            if "rounding_step" in entry and entry["rounding_step"].numel() != 1:
                raise ValueError("{}.load_state_dict: rounding_step {} has shape {}, not one number".format(
                    self.optimizer, i, list(entry["rounding_step"].shape)))

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Restore a ``state_dict()``; checked whole (``check_state_dict``) before anything changes.  A
        half-precision parameter counts its rounding steps on from the entry's ``"rounding_step"`` (from 0
        again without one, as a state dict written before it was kept)."""
        self.check_state_dict(state)
        tensors: List[Optional[List[Tensor]]] = [None for _ in self.params]
        for i, entry in state.items():
            if "rounding_step" in entry and is_half(self.params[i].dtype):
                self.rounding_steps[i] = int(entry["rounding_step"])
            restored: List[Tensor] = []
            for k in range(len(self.names)):
                made = self._new(k, self.params[i])
                if self.names[k] in entry:
                    made.copy_(entry[self.names[k]])
                else:
                    made.fill_(True)
                restored.append(made)
            tensors[i] = restored
        self.tensors = tensors


class RowStep:
    """``gradients`` (one per parameter of ``state``, ``None`` to skip one) split for one step; ``begun``: the
    step's ``RowState.begin_step`` was done already (by an optimizer that steps a push's rows in parts: each
    part's ``RowStep`` then reads the state and writes only its own rows), else it is done here.

    ``dense_*``: the parameters with dense gradients, those gradients and their whole state (kind-major);
    ``row_*``: for each parameter with a row-sparse gradient that touches rows, the touched rows
    (``rows``, ascending) of the parameter, the gradient (duplicates summed) and the state (``"scalar"``
    kinds: the parameter's tensor itself, updated in place).  A half-precision parameter's rows and
    gradient are float32 copies (a dense gradient of one is taken as touching every row).  ``*_index``: each one's parameter index.
    The optimizer updates the lists in place, then calls ``scatter()``, which writes the rows back.
    """

    def __init__(self, state: RowState, gradients: List[Optional[Tensor]], begun: bool = False):
        if not begun:
            state.begin_step(gradients)
        self.state = state
        kinds = len(state.names)
        self.dense_index: List[int] = []
        self.dense_params: List[Tensor] = []
        self.dense_grads: List[Tensor] = []
        self.dense_state: List[List[Tensor]] = [[] for _ in range(kinds)]
        self.row_index: List[int] = []
        self.rows: List[Tensor] = []
        self.row_params: List[Tensor] = []
        self.row_grads: List[Tensor] = []
        self.row_state: List[List[Tensor]] = [[] for _ in range(kinds)]
        for i in range(len(state.params)):
            grad = gradients[i]
            if grad is not None:
                param = state.params[i]
                tensors = state.of(i)
                half = is_half(param.dtype)
                if grad.is_sparse or half:
                    if grad.is_sparse:
                        rows, values = sparse_rows(grad)
                    else:  # every row, in order
                        rows, values = torch.arange(param.size(0), device=param.device), grad
                    if rows.numel() > 0:
                        self.row_index.append(i)
                        self.rows.append(rows)
                        if half:
                            self.row_params.append(param.index_select(0, rows).to(torch.float32))
                            self.row_grads.append(values.to(torch.float32))
                        else:
                            self.row_params.append(param.index_select(0, rows))
                            self.row_grads.append(values)
                        for k in range(kinds):
                            if state.layouts[k] == "scalar":
                                self.row_state[k].append(tensors[k])
                            else:
                                self.row_state[k].append(tensors[k].index_select(0, rows))
                else:
                    self.dense_index.append(i)
                    self.dense_params.append(param)
                    self.dense_grads.append(grad)
                    for k in range(kinds):
                        self.dense_state[k].append(tensors[k])

    def has_rows(self) -> bool:
        return len(self.row_params) > 0

    def has_dense(self) -> bool:
        return len(self.dense_params) > 0

    def scatter(self) -> None:
        """The updated rows of every parameter and state tensor written back in place."""
        state = self.state
        for j in range(len(self.row_params)):
            i = self.row_index[j]
            rows = self.rows[j]
            state.params[i].index_copy_(0, rows, state.rounded(i, self.row_params[j], rows))
            tensors = state.of(i)
            for k in range(len(state.names)):
                if state.layouts[k] != "scalar":
                    tensors[k].index_copy_(0, rows, self.row_state[k][j])
