"""The house's layering, read from the source.

Imports only run down a floor: ``checkpoint/`` is a leaf (it imports nothing of the package but ``filesystems``, ``logs``,
``tables`` and ``_torch_compat``), ``shards/`` and ``ddp/`` never import ``metrics/`` (a recorder is handed
down), ``optim/``'s optimizers never import ``shards/`` (only ``DistributedOptimizer``, a client of the shard
service, does); the control plane never imports the data plane's internals, nor they it.  A shard answers
through one door: every RPC target a trainer names lives in ``shards/server/service.py``, the only module
that defines custom ops or finds the process's state.  No module keeps mutable state in a global, besides
the registries meant to be extended.  Private torch names appear only in ``paramserver/_torch_compat.py``.
The jobs that ship with the package (``jobs/``) sit at the top, beside a cluster's own: nothing imports them
(the default job is named by string).
"""

import ast
import os
import pathlib
import subprocess
import sys
import time

import pytest

from paramserver._torch_compat import TORCHSCRIPT_PRIVATE_OPS, TORCHSCRIPT_PRIVATE_TENSOR_METHODS

ROOT = pathlib.Path(__file__).resolve().parents[1] / "paramserver"
SERVICE = ROOT / "shards" / "server" / "service.py"


def parse(source: str) -> ast.AST:
    """``ast.parse``, again when CPython 3.11 reports its AST recursion counter out of step ("AST constructor
    recursion depth mismatch", a defect of 3.11's parser when threads parse at once): a thread an earlier
    test file left in this process (TorchScript compiling a function parses its source) may parse at the
    same moment, now that ``make test`` runs several files in one worker process."""
    for attempt in range(5):
        try:
            return ast.parse(source)
        except SystemError:
            if attempt == 4:
                raise
            time.sleep(0.05)


def modules():
    return [path for path in ROOT.rglob("*.py") if path.parent.name != "v1"]  # v1: generated stubs


def imported_modules(module: pathlib.Path) -> set:
    """The ``paramserver.*`` modules ``module`` imports (relative imports resolved), as dotted names."""
    package = ["paramserver", *module.relative_to(ROOT).parent.parts]
    found = set()
    for node in ast.walk(parse(module.read_text())):
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
        found.update(name for name in names if name.startswith("paramserver."))
    return found


def imported_packages(module: pathlib.Path) -> set:
    """The ``paramserver.<package>`` names a module imports."""
    return {name.split(".")[1] for name in imported_modules(module)}


def importers(of: str, within: str) -> list:
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / within).rglob("*.py")
                  if of in imported_packages(path))


def test_checkpoint_is_a_leaf():
    allowed = {"checkpoint", "filesystems", "logs", "tables", "_torch_compat"}
    for module in (ROOT / "checkpoint").rglob("*.py"):
        assert imported_packages(module) <= allowed, (module.name, imported_packages(module) - allowed)


def test_export_and_serving_load_neither_the_runtime_nor_the_shards():
    for module in (ROOT / "serving.py", ROOT / "checkpoint" / "export.py"):
        assert not imported_packages(module) & {"runtime", "shards", "train"}, module.name


def test_shards_and_ddp_are_handed_their_recorders_and_never_import_metrics():
    assert importers("metrics", "shards") == []
    assert importers("metrics", "ddp") == []


def test_optimizers_never_import_shards_only_the_distributed_optimizer_does():
    assert importers("shards", "optim") == ["optim/distributed.py"]
    assert importers("optim", "shards") == ["shards/server/optimizers.py"]  # the owner side runs optim's optimizers


def test_the_control_plane_and_the_data_plane_do_not_import_each_other():
    for data_plane in ("shards", "optim", "ddp"):
        assert importers(data_plane, "control") == [], data_plane
        assert importers("control", data_plane) == [], data_plane


def test_nothing_imports_the_jobs_that_ship():
    assert [path for path in importers("jobs", ".") if not path.startswith("jobs/")] == []
    assert importers("jobs", "jobs") == ["jobs/ctr.py", "jobs/ctr_files.py"]  # the check reads the right tree


def _rpc_targets(module: pathlib.Path):
    """The functions ``module`` names in ``rpc.rpc_async / rpc_sync / remote`` calls, as written."""
    for node in ast.walk(parse(module.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("rpc_async", "rpc_sync", "remote") and len(node.args) >= 2:
            yield ast.unparse(node.args[1])


def test_every_rpc_target_is_the_shard_services():
    named = {target for module in modules() for target in _rpc_targets(module)}
    assert named, "no RPC call found: the check reads the wrong tree"
    # ``function``: a parameter of a helper whose callers pass service functions (checked below by name);
    # ``backend_registry._get_device_infos``: torch's own, which a join asks of every member (``_torch_compat``
    # asks it first, to find a member that died: ``forget_dead_peers_when_joining``).
    assert {target for target in named if not target.startswith("service.")} <= \
        {"function", "backend_registry._get_device_infos"}, named
    for module in modules():
        if module == SERVICE:
            continue
        text = module.read_text()
        assert "torch.library.Library(" not in text, f"{module.relative_to(ROOT)} defines custom ops"
        assert "_process_state" not in text and "ShardState.current" not in text, \
            f"{module.relative_to(ROOT)} looks up the shard's state"
        for node in ast.walk(parse(text)):  # helpers that send RPCs are handed the service's functions
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("_on_every_owner", "_per_owner"):
                assert ast.unparse(node.args[0 if node.func.attr == "_on_every_owner" else 1]).startswith("service.")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_per_owner":
                assert ast.unparse(node.args[1]).startswith("service.")


#: Module-level state meant to be there: registries meant to be extended, and the shard service's door and
#: custom ops (torch RPC has one agent per process: the door is the one place a request finds its state).
ALLOWED_GLOBALS = {("optim/registry.py", "functional_optim_map"), ("shards/server/service.py", "_process_state"),
                   ("shards/server/service.py", "_ops")}
_IMMUTABLE_CALLS = {"logging.getLogger", "TypeVar", "re.compile", "datetime.timedelta", "tuple", "frozenset",
                    "object", "pow", "_signed", "np.full"}


def test_no_module_keeps_mutable_state_in_a_global():
    found = set()
    for module in modules():
        for node in parse(module.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = getattr(target, "id", "")
                if not name or name == "__all__" or name.lstrip("_").isupper():
                    continue  # constants are named in capitals
                value = node.value
                callee = ast.unparse(value.func) if isinstance(value, ast.Call) else ""
                mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp)) or \
                    (isinstance(value, ast.Call) and callee not in _IMMUTABLE_CALLS)
                if mutable:
                    found.add((str(module.relative_to(ROOT)), name))
    assert found == ALLOWED_GLOBALS, sorted(found ^ ALLOWED_GLOBALS)


def private_torch_names(module: pathlib.Path) -> set:
    """``_name`` attributes read off torch or its modules (``torch._x``, ``rpc.api._y``...) or off
    tensors in a module (any ``._x(`` call on something that is not ``self``/``cls``/a module of ours)."""
    torch_modules = {"torch", "rpc", "dist", "dist_autograd", "api", "jit", "_state", "c10d"}
    found = set()
    for node in ast.walk(parse(module.read_text())):
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
    for module in modules():
        if module.name == "_torch_compat.py":
            continue
        leftover = private_torch_names(module) - allowed
        assert not leftover, f"{module.relative_to(ROOT)} uses {sorted(leftover)}: name it in _torch_compat"


def test_importing_the_package_and_making_a_shard_state_compiles_and_loads_no_kernel(tmp_path):
    """The dynamic tables' C kernel is loaded by a shard state when it hosts its first dynamic table, not
    before: importing the package (and ``Table``) and making a ``ShardState`` load nothing."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("reads the libraries a process loaded from /proc/self/maps (Linux)")
    code = ("import paramserver, paramserver.shards\n"
            "from paramserver.train import Table\n"
            "from paramserver.shards.server import ShardState\n"
            "ShardState()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('_kernel_' in maps or 'dynamic-tables-' in maps)\n")
    cache = tmp_path / "cache"
    env = {key: value for key, value in os.environ.items() if key != "PARAMSERVER_NATIVE"}  # the best build
    done = subprocess.run([sys.executable, "-c", code], env=dict(env, PARAMSERVER_CACHE=str(cache)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False" and not cache.exists()
