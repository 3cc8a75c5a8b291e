"""deploy/: the container image definition and the Kubernetes manifests, checked offline.

Owns the checks of ``deploy/Dockerfile`` and ``deploy/k8s/*.yaml``:

* every manifest validates against the Kubernetes schemas shipped by the
  ``kubernetes-validate`` package, in strict mode (unknown fields are
  errors), and a deliberately broken manifest is rejected by the same
  validation, so it cannot pass silently;
* the manifests agree with each other (the workers' ``--connect`` names the
  coordinator pod's DNS name through the headless Service, the Secret the
  pods mount exists and holds the file ``--token-file`` reads, the shard
  token goes to the ps-server pods only, the admin token to the coordinator's
  pod only, probes hit
  the port given to ``--port``, ``--host`` comes from the pod's IP) and with
  the real command-line parsers (``paramserver.cli.*.add_arguments``);
* the Dockerfile installs ``torch==2.13.0`` from the CPU index before the
  package, and runs as a non-root user.

No network, no cluster, no Docker: plain files, schemas and argparse.
"""

import argparse
import pathlib
import re
import shlex
from typing import Dict, Iterator, List, Tuple

import kubernetes_validate  # the test extra (setup.cfg); no skip: a missing validator must not pass silently
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"

#: The Kubernetes release whose API schemas the manifests are checked against
#: (kubernetes-validate ships 1.25 ... 1.37 in its 1.37 release). The features
#: used (gRPC probes, Job podFailurePolicy) are GA from 1.31 on.
KUBERNETES_VERSION = "1.33"
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: What Kubernetes substitutes for $(POD_IP) (the downward API); a string for argparse only.
POD_IP_EXAMPLE = "10.244.1.7"
#: The entry point each container's command names -> its module in paramserver.cli.
COMMAND_MODULES = {"ps-server": "server", "ps-worker": "worker", "ps-ctl": "ctl"}
#: What Kubernetes substitutes for $(POD_INDEX) (a StatefulSet pod's ordinal, from its pod-index label).
POD_INDEX_EXAMPLE = "3"


# --- loading and validating ---------------------------------------------------------------------------------------

def manifest_files() -> List[pathlib.Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def load_documents(path: pathlib.Path) -> List[dict]:
    """Every non-empty YAML document of ``path`` (multi-document files allowed)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def validation_errors(doc: dict) -> List[str]:
    """Why ``doc`` is no valid Kubernetes object of its kind in strict mode; empty when it is."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(part) for part in error.path) or "(top)"
        return [f"{where}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        # The command-line tool only warns here; for us an unknown kind is an error.
        return [error.message]
    return []


def file_errors(path: pathlib.Path) -> List[str]:
    try:
        docs = load_documents(path)
    except yaml.YAMLError as error:
        return [f"{path.name}: not YAML: {error}"]
    if not docs:
        return [f"{path.name}: no documents"]
    errors = []
    for doc in docs:
        name = "?"
        if isinstance(doc, dict):
            name = f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"
        errors += [f"{path.name} {name}: {e}" for e in validation_errors(doc)]
    return errors


@pytest.fixture(scope="module")
def objects() -> Dict[Tuple[str, str], dict]:
    """Every object of deploy/k8s by (kind, name); names are unique per kind."""
    found: Dict[Tuple[str, str], dict] = {}
    for path in manifest_files():
        for doc in load_documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} is defined twice"
            found[key] = doc
    return found


def of_kind(objects, kind: str) -> List[dict]:
    return [doc for (k, _), doc in objects.items() if k == kind]


def pod_specs(objects) -> Iterator[Tuple[str, dict]]:
    for kind in ("StatefulSet", "Job", "Deployment", "DaemonSet"):
        for doc in of_kind(objects, kind):
            yield f"{kind}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]


def containers(objects) -> Iterator[Tuple[str, dict, dict]]:
    """(owner, pod spec, container) of every container the manifests run."""
    for owner, spec in pod_specs(objects):
        for container in spec.get("initContainers", []) + spec["containers"]:
            yield f"{owner}/{container['name']}", spec, container


def option(args: List[str], flag: str):
    """The value given to ``flag`` (``--flag V`` or ``--flag=V``); None when absent."""
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# --- schema validation ----------------------------------------------------------------------------------------------

def test_the_schemas_of_the_chosen_kubernetes_release_are_shipped():
    shipped = {kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()}
    assert KUBERNETES_VERSION in shipped, (f"kubernetes-validate {kubernetes_validate.__version__} ships no schemas "
                                           f"for Kubernetes {KUBERNETES_VERSION} (it has {sorted(shipped)})")


def test_there_are_manifests_of_every_expected_kind(objects):
    kinds = {kind for kind, _ in objects}
    assert {"Service", "StatefulSet", "Job", "Secret"} <= kinds, kinds
    assert len(manifest_files()) >= 3


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schemas_in_strict_mode(path):
    assert file_errors(path) == []


def _coordinator_statefulset() -> dict:
    return next(doc for doc in load_documents(K8S / "cluster.yaml") if doc["kind"] == "StatefulSet")


def _break_unknown_field(doc):
    doc["spec"]["template"]["spec"]["containers"][0]["argz"] = ["--shards", "4"]


def _break_unknown_metadata_field(doc):
    doc["metadata"]["lables"] = {"app": "paramserver"}


def _break_wrong_type(doc):
    doc["spec"]["replicas"] = "one"


def _break_probe_port_by_name(doc):
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"


def _break_missing_required(doc):
    del doc["spec"]["template"]["spec"]["containers"][0]["name"]


def _break_unknown_kind(doc):
    doc["kind"] = "StatefullSet"


@pytest.mark.parametrize("breakage", [_break_unknown_field, _break_unknown_metadata_field, _break_wrong_type,
                                      _break_probe_port_by_name, _break_missing_required, _break_unknown_kind],
                         ids=lambda f: f.__name__[len("_break_"):])
def test_a_broken_manifest_is_rejected(breakage, tmp_path):
    doc = _coordinator_statefulset()
    assert validation_errors(doc) == []  # the same object, unbroken, passes
    breakage(doc)
    assert validation_errors(doc), f"{breakage.__name__}: the broken manifest passed validation"
    # The same, read from a multi-document file next to a valid object.
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all([load_documents(K8S / "cluster.yaml")[0], doc]))
    assert len(file_errors(path)) == 1


def test_strict_mode_is_what_rejects_unknown_fields():
    doc = _coordinator_statefulset()
    _break_unknown_field(doc)
    # Without strict mode the schemas let unknown fields through: strictness is doing the work.
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=False)
    assert any("argz" in error for error in validation_errors(doc))


def test_a_file_that_is_not_yaml_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("apiVersion: v1\nkind: Service\nmetadata: {name: x\n")
    assert file_errors(path)


# --- cross-references -----------------------------------------------------------------------------------------------

def _headless_service(objects) -> dict:
    services = [s for s in of_kind(objects, "Service") if s["spec"].get("clusterIP") == "None"]
    assert len(services) == 1, "expected one headless Service"
    return services[0]


def _coordinator(objects) -> Tuple[dict, dict]:
    """The StatefulSet that runs ps-server without --join, and its container."""
    found = []
    for sts in of_kind(objects, "StatefulSet"):
        for container in sts["spec"]["template"]["spec"]["containers"]:
            if container["command"][0] == "ps-server" and option(container["args"], "--join") is None:
                found.append((sts, container))
    assert len(found) == 1, "expected one coordinator StatefulSet (ps-server without --join)"
    return found[0]


def _coordinator_address(objects) -> str:
    sts, container = _coordinator(objects)
    service = _headless_service(objects)
    return f"{sts['metadata']['name']}-0.{service['metadata']['name']}:{option(container['args'], '--port')}"


def test_statefulsets_get_stable_names_from_the_headless_service(objects):
    service = _headless_service(objects)
    selector = service["spec"]["selector"]
    statefulsets = of_kind(objects, "StatefulSet")
    assert len(statefulsets) >= 2  # the coordinator and the extra shard hosts
    for sts in statefulsets:
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert sts["spec"]["serviceName"] == service["metadata"]["name"]
        assert selector.items() <= labels.items(), f"the Service does not select {sts['metadata']['name']}'s pods"
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Selectors of different StatefulSets must not overlap (each owns its pods).
    selectors = [tuple(sorted(s["spec"]["selector"]["matchLabels"].items())) for s in statefulsets]
    assert len(set(selectors)) == len(selectors)


def test_the_coordinator_is_one_pod_whose_port_the_service_names(objects):
    sts, container = _coordinator(objects)
    assert sts["spec"]["replicas"] == 1
    port = int(option(container["args"], "--port"))
    assert port in [p["port"] for p in _headless_service(objects)["spec"]["ports"]]
    assert port in [p["containerPort"] for p in container["ports"]]
    # The shards live on the shard hosts, so a restart of the coordinator's pod touches none of them, and the
    # journal on a volume of its own, kept across restarts.
    assert int(option(container["args"], "--shards")) == 0
    state_dir = option(container["args"], "--state-dir")
    claims = [t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])]
    assert [m for m in container["volumeMounts"] if m["mountPath"] == state_dir and m["name"] in claims], state_dir


def test_workers_connect_to_the_coordinator_pod_through_the_headless_service(objects):
    jobs = [job for job in of_kind(objects, "Job")
            if job["spec"]["template"]["spec"]["containers"][0]["command"][0] == "ps-worker"]
    assert len(jobs) == 1
    job = jobs[0]
    assert job["spec"]["parallelism"] == 2
    # Elastic (scaled by patching both together): Indexed, completions == parallelism.
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert option(container["args"], "--connect") == _coordinator_address(objects)


def test_shard_hosts_join_the_coordinator_pod(objects):
    joining = [(sts, c) for sts in of_kind(objects, "StatefulSet")
               for c in sts["spec"]["template"]["spec"]["containers"] if option(c["args"], "--join") is not None]
    assert joining, "expected a StatefulSet of extra shard hosts (ps-server --join)"
    for sts, container in joining:
        assert option(container["args"], "--join") == _coordinator_address(objects)
        assert int(option(container["args"], "--shards")) >= 1


def mounted_secret_files(objects, owner: str, spec: dict, container: dict) -> Dict[str, str]:
    """The files of the Secrets ``container`` mounts, path -> Secret name; every Secret and key must exist."""
    secrets = {s["metadata"]["name"]: s for s in of_kind(objects, "Secret")}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])  # a volume of the pod, or one of its StatefulSet's volume claims
        if volume is None or "secret" not in volume:
            continue
        name = volume["secret"]["secretName"]
        assert name in secrets, f"{owner} mounts Secret {name!r}, which no manifest defines"
        keys = set(secrets[name].get("stringData", {})) | set(secrets[name].get("data", {}))
        items = volume["secret"].get("items") or [{"key": k, "path": k} for k in keys]
        for item in items:
            assert item["key"] in keys, f"{owner}: Secret {name!r} has no key {item['key']!r}"
            files[str(pathlib.PurePosixPath(mount["mountPath"]) / item["path"])] = name
        assert mount.get("readOnly") is True
    return files


def test_the_secret_the_pods_mount_exists_and_holds_the_token_file(objects):
    checked = 0
    for owner, spec, container in containers(objects):
        token_file = option(container["args"], "--token-file")
        assert token_file, f"{owner} passes no --token-file"
        files = mounted_secret_files(objects, owner, spec, container)
        assert token_file in files, f"{owner}: --token-file {token_file} is not a file of a mounted Secret"
        checked += 1
    assert checked >= 3


def test_only_the_ps_servers_get_the_shard_token(objects):
    """The coordinator and the shard hosts share a shard token (their own Secret, not the cluster token's);
    no other pod mounts it, so a worker's token admits no shard."""
    shard_secrets, others = set(), []
    for owner, spec, container in containers(objects):
        files = mounted_secret_files(objects, owner, spec, container)
        shard_token_file = option(container["args"], "--shard-token-file")
        if container["command"] != ["ps-server"]:
            assert shard_token_file is None, owner
            others.append((owner, set(files.values())))
            continue
        assert shard_token_file in files, f"{owner}: --shard-token-file {shard_token_file} is not a mounted Secret's"
        assert files[shard_token_file] != files[option(container["args"], "--token-file")], owner
        shard_secrets.add(files[shard_token_file])
    assert len(shard_secrets) == 1, f"the ps-servers must share one shard token: {shard_secrets}"
    assert others, "expected workers"
    for owner, mounted in others:
        assert not mounted & shard_secrets, f"{owner} mounts the shard token"


def test_only_the_coordinator_gets_the_admin_token(objects):
    """Checkpoint and Shutdown need the admin token (a Secret of its own): the coordinator reads it, and no
    other pod mounts it, so neither a worker nor a shard host can stop the cluster."""
    admin_secrets, others = set(), []
    for owner, spec, container in containers(objects):
        files = mounted_secret_files(objects, owner, spec, container)
        admin_token_file = option(container["args"], "--admin-token-file")
        if container["command"] != ["ps-server"] or option(container["args"], "--join") is not None:
            assert admin_token_file is None, owner
            others.append((owner, set(files.values())))
            continue
        assert admin_token_file in files, f"{owner}: --admin-token-file {admin_token_file} is not a mounted Secret's"
        assert files[admin_token_file] not in (files[option(container["args"], flag)]
                                               for flag in ("--token-file", "--shard-token-file")), owner
        admin_secrets.add(files[admin_token_file])
    assert len(admin_secrets) == 1, f"one coordinator, one admin token: {admin_secrets}"
    assert len(others) >= 2, "expected workers and shard hosts"
    for owner, mounted in others:
        assert not mounted & admin_secrets, f"{owner} mounts the admin token"


def test_grpc_probes_hit_the_port_passed_to_port(objects):
    probed = 0
    for owner, _, container in containers(objects):
        probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")
                  if kind in container}
        if not probes:
            continue
        assert {"readinessProbe", "livenessProbe"} <= probes.keys(), owner
        port = option(container["args"], "--port")
        assert port is not None, f"{owner} has probes but no --port"
        for kind, probe in probes.items():
            assert "grpc" in probe, f"{owner} {kind}: use the gRPC health service (a grpc: probe)"
            assert probe["grpc"]["port"] == int(port), f"{owner} {kind} probes {probe['grpc']['port']}, --port {port}"
        assert int(port) in [p["containerPort"] for p in container["ports"]]
        probed += 1
    assert probed >= 1  # the coordinator


def test_host_is_the_pods_ip_from_the_downward_api(objects):
    for owner, _, container in containers(objects):
        assert option(container["args"], "--host") == "$(POD_IP)", owner
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", owner
        for arg in container["args"]:  # every $(VAR) is one the container defines
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                assert var in env, f"{owner}: $({var}) is not in its env"


def test_every_container_has_resource_requests_and_limits_and_runs_unprivileged(objects):
    for owner, spec, container in containers(objects):
        resources = container["resources"]
        for section in ("requests", "limits"):
            assert {"cpu", "memory"} <= resources[section].keys(), f"{owner}: {section}"
        assert resources["requests"]["memory"] == resources["limits"]["memory"], owner
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        assert spec["securityContext"]["runAsUser"] == _dockerfile_uid(), owner
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, owner


def test_the_network_policy_admits_every_member(objects):
    (policy,) = of_kind(objects, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for owner, spec in pod_specs(objects):
        kind, name = owner.split("/")
        labels = objects[(kind, name)]["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{owner} is outside the NetworkPolicy's members"


def test_every_container_runs_the_same_image(objects):
    images = {container["image"] for _, _, container in containers(objects)}
    assert len(images) == 1, images


# --- flags against the real parsers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parsers() -> Dict[str, argparse.ArgumentParser]:
    """Each command's parser, built by its own ``add_arguments`` (imports torch: the slow part)."""
    import importlib

    built = {}
    for command, module in COMMAND_MODULES.items():
        parser = argparse.ArgumentParser(prog=command, exit_on_error=False)
        importlib.import_module(f"paramserver.cli.{module}").add_arguments(parser)
        built[command] = parser
    return built


def _known_flags(parser: argparse.ArgumentParser) -> set:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_every_flag_in_the_manifests_exists_in_its_command(objects, parsers):
    checked = 0
    for owner, _, container in containers(objects):
        command = container["command"]
        assert len(command) == 1 and command[0] in parsers, f"{owner}: unknown command {command}"
        parser = parsers[command[0]]
        known = _known_flags(parser)
        args = [arg.replace("$(POD_IP)", POD_IP_EXAMPLE).replace("$(POD_INDEX)", POD_INDEX_EXAMPLE)
                for arg in container["args"]]
        for arg in args:
            if arg.startswith("--"):
                # Exact names: argparse would also take an abbreviation, Kubernetes users should not rely on it.
                assert arg.split("=", 1)[0] in known, f"{owner}: {command[0]} has no flag {arg}"
        kept = args
        try:
            parsed = parser.parse_args(kept)
        except (argparse.ArgumentError, SystemExit) as error:
            pytest.fail(f"{owner}: {command[0]} {shlex.join(kept)}: {error}")
        if getattr(parsed, "host", None) is not None:
            assert parsed.host == POD_IP_EXAMPLE
        checked += 1
    assert checked >= 3


# --- the image ------------------------------------------------------------------------------------------------------

def _dockerfile_instructions() -> List[Tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def _dockerfile_uid() -> int:
    users = [args for instruction, args in _dockerfile_instructions() if instruction == "USER"]
    assert users, "the Dockerfile sets no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user.isdigit(), f"USER {user}: give a numeric uid (Kubernetes' runAsNonRoot can only check those)"
    return int(user)


def _pip_installs(command: str) -> List[List[str]]:
    """The argument lists of every ``pip install`` in a RUN command."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: List[List[str]] = [[]]
    for token in lexer:  # split on && ; || | (quoted ones stay inside their word)
        if token in ("&&", ";", "||", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    installs = []
    for words in commands:
        for i in range(len(words) - 1):
            if words[i] in ("pip", "pip3") and words[i + 1] == "install":
                installs.append(words[i + 2:])
                break
            if words[i:i + 3] == ["-m", "pip", "install"]:
                installs.append(words[i + 3:])
                break
    return installs


def test_the_image_installs_pinned_cpu_torch_before_the_package():
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    installs = [words for instruction, args in instructions if instruction == "RUN" for words in _pip_installs(args)]
    torch_at = next(i for i, words in enumerate(installs) if TORCH_PIN in words)
    package_at = next(i for i, words in enumerate(installs) if "." in words)
    assert torch_at < package_at, "torch must be installed before the package"
    assert CPU_INDEX in installs[torch_at] and installs[torch_at][installs[torch_at].index(CPU_INDEX) - 1] in (
        "--index-url", "-i"), "torch comes from PyTorch's CPU index"
    for words in installs:  # any torch named anywhere is the pinned one
        named = [w for w in words if re.match(r"^torch([<>=!~ ]|$)", w)]
        assert all(w == TORCH_PIN for w in named), named
    # The Makefile's pin (the local venv) is the same release.
    assert f"TORCH_PIN := {TORCH_PIN}" in (ROOT / "Makefile").read_text()


def test_the_image_runs_as_a_non_root_user_with_the_entry_points():
    instructions = _dockerfile_instructions()
    kinds = [instruction for instruction, _ in instructions]
    assert "USER" in kinds
    last_user = len(kinds) - 1 - kinds[::-1].index("USER")
    assert _dockerfile_uid() != 0
    assert all(kind != "RUN" or "pip install" not in args for kind, args in instructions[last_user:])
    setup_cfg = (ROOT / "setup.cfg").read_text()
    for entry in COMMAND_MODULES:
        assert re.search(rf"^\s*{entry} = paramserver\.cli\.", setup_cfg, re.M), entry
    # The build context leaves out what the image must make itself.
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "**/*_pb2.py", "**/*_pb2_grpc.py"} <= set(ignored)
    copied = " ".join(args for kind, args in instructions if kind == "COPY")
    for needed in ("setup.py", "setup.cfg", "pyproject.toml", "protos", "paramserver"):
        assert needed in copied, f"the image build needs {needed}"
    assert "workers" not in copied, "the default job ships in paramserver.jobs; workers/ is not installed"


def test_the_deployment_page_names_only_deploy_files_that_exist():
    page = ROOT / "docs" / "deployment.md"
    named = set(re.findall(r"deploy/[\w./-]+[\w]", page.read_text()))
    assert named, "the deployment page names the deploy files"
    for path in named:
        assert (ROOT / path).exists(), f"docs/deployment.md names {path}, which does not exist"
