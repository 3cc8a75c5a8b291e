"""The house's layering, read from the source: ``paramserver.shards`` never imports ``paramserver.optim``
(the owner side of optimizers reads the shard's state, not the other way round), so there is no import
cycle between them; the control plane never imports the data plane's internals, nor they it."""

import ast
import pathlib

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
