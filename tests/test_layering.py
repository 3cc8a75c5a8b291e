"""The house's layering, read from the source: ``paramserver.shards`` never imports ``paramserver.optim``
(the owner side of optimizers reads the shard's state, not the other way round), so there is no import
cycle between them; the control plane never imports the data plane's internals, nor they it; private torch
names appear only in ``paramserver/_torch_compat.py``."""

import ast
import pathlib

from paramserver._torch_compat import TORCHSCRIPT_PRIVATE_OPS, TORCHSCRIPT_PRIVATE_TENSOR_METHODS

ROOT = pathlib.Path(__file__).resolve().parents[1] / "paramserver"


def imported_packages(module: pathlib.Path) -> set:
    """The ``paramserver.<package>`` names a module imports (relative imports resolved)."""
    package = ["paramserver", *module.relative_to(ROOT).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
                if not node.module:
                    names = [".".join(base + [alias.name]) for alias in node.names]
            else:
                names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "paramserver" and len(parts) > 1:
                found.add(parts[1])
    return found


def importers(of: str, within: str) -> list:
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / within).rglob("*.py")
                  if of in imported_packages(path))


def test_shards_never_import_optim_so_there_is_no_cycle():
    assert importers("optim", "shards") == []
    assert importers("shards", "optim")  # the direction that is allowed, and used


def test_the_control_plane_and_the_data_plane_do_not_import_each_other():
    for data_plane in ("shards", "optim", "ddp"):
        assert importers(data_plane, "control") == [], data_plane
        assert importers("control", data_plane) == [], data_plane


def private_torch_names(module: pathlib.Path) -> set:
    """``_name`` attributes read off torch or its modules (``torch._x``, ``rpc.api._y``...) or off
    tensors in a module (any ``._x(`` call on something that is not ``self``/``cls``/a module of ours)."""
    torch_modules = {"torch", "rpc", "dist", "dist_autograd", "api", "jit", "_state", "c10d"}
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if name in torch_modules:
                found.add(node.attr)
            elif name not in ("self", "cls", "os", "group", "sys") and isinstance(node.ctx, ast.Load):
                found.add(node.attr)
    return found


def test_private_torch_names_go_through_the_compat_module():
    allowed = set(TORCHSCRIPT_PRIVATE_OPS) | set(TORCHSCRIPT_PRIVATE_TENSOR_METHODS)
    for module in ROOT.rglob("*.py"):
        if module.name == "_torch_compat.py" or module.parent.name == "v1":  # v1: generated stubs
            continue
        leftover = private_torch_names(module) - allowed
        assert not leftover, f"{module.relative_to(ROOT)} uses {sorted(leftover)}: name it in _torch_compat"
