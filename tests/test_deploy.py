"""deploy/ (what `kubectl apply -k deploy/` installs) and the Dockerfile of the reconciler's image.

Every object is checked against the Kubernetes 1.30 schemas; the ClusterRole is compared with
the rules derived from kube/client.py CALLS, so a call added there without its permission (or
a permission left behind) fails here.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from celpy import celtypes
from celpy.evaluation import CELEvalError

from gitops_sless import paths
from gitops_sless.kube.client import CALLS, KINDS, OWN_NAMESPACE_ONLY

from .paths import ROOT

DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
NAMESPACE = "gitops-sless"
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
EXAMPLE_SECRET = "secret.example.yaml"  # the admin fills and applies it; not in the kustomization


# --- loading -----------------------------------------------------------------------------


@cache
def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text(encoding="utf-8"))


def _resources() -> list[str]:
    return list(_kustomization()["resources"])


@cache
def _objects() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(file, object) for every object of the kustomization's files and the example Secret."""
    found = []
    for name in [*_resources(), EXAMPLE_SECRET]:
        text = (DEPLOY / name).read_text(encoding="utf-8")
        found.extend((name, obj) for obj in yaml.safe_load_all(text) if obj)
    return tuple(found)


def _one(kind: str, name: str = NAMESPACE) -> dict[str, Any]:
    matches = [o for _, o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name} in deploy/, found {len(matches)}"
    return matches[0]


def _object_id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}:{item[1]['kind']}/{item[1]['metadata']['name']}"


# --- every object --------------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest_but_the_example_secret():
    listed = _resources()
    assert len(listed) == len(set(listed))
    for name in listed:
        assert (DEPLOY / name).is_file(), f"kustomization.yaml lists {name}, which is missing"
    manifests = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert EXAMPLE_SECRET in manifests
    assert EXAMPLE_SECRET not in listed, "the example Secret holds placeholders: never applied"
    assert manifests - {EXAMPLE_SECRET} == set(listed), "a manifest in deploy/ is not listed"


@pytest.mark.parametrize("item", _objects(), ids=_object_id)
def test_every_object_is_valid_kubernetes_1_30(item):
    name, obj = item
    try:
        kubernetes_validate.validate(obj, "1.30", strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {exc.message}")


@pytest.mark.parametrize("item", _objects(), ids=_object_id)
def test_namespaced_objects_live_in_the_reconcilers_namespace(item):
    _, obj = item
    if obj["kind"] in CLUSTER_SCOPED:
        assert "namespace" not in obj["metadata"]
    else:
        assert obj["metadata"].get("namespace") == NAMESPACE


def test_the_namespace_is_created_with_the_rest():
    assert _one("Namespace")["metadata"]["name"] == NAMESPACE
    assert _resources().index("namespace.yaml") == 0


def test_the_example_secret_holds_placeholders_only():
    secret = _one("Secret", "gitops-sless-secrets")
    assert "data" not in secret
    assert set(secret["stringData"]) >= {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "SLESS_API_TOKEN",
        "SLESS_WEBHOOK_SECRET",
    }
    assert set(secret["stringData"].values()) == {"REPLACE-ME"}


def test_every_setting_in_the_configmap_and_secret_is_read_by_the_code():
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "gitops_sless").rglob("*.py"))
    args = _container()["args"]
    keys = [
        *_one("ConfigMap", "gitops-sless-config")["data"],
        *_one("Secret", "gitops-sless-secrets")["stringData"],
    ]
    for key in keys:
        assert f'"{key}"' in source or f"$({key})" in " ".join(args), f"{key} is read by nothing"


# --- RBAC ----------------------------------------------------------------------------------


def _derived_rules(own_namespace: bool = False) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every call in CALLS: those of the kinds used only in
    the reconciler's namespace (``own_namespace``, a Role) or of the others (ClusterRole)."""
    rules: set[tuple[str, str, str]] = set()
    for kind_name, verbs in CALLS.items():
        if (kind_name in OWN_NAMESPACE_ONLY) != own_namespace:
            continue
        kind = KINDS[kind_name]
        for verb in verbs:
            if verb == "apply":  # server-side apply
                granted = [(kind.plural, "create"), (kind.plural, "patch")]
            elif verb == "log":
                granted = [(f"{kind.plural}/log", "get")]
            elif verb == "proxy":  # a GET through the API server's proxy
                granted = [(f"{kind.plural}/proxy", "get")]
            elif verb == "status":  # a server-side apply of the status subresource
                granted = [(f"{kind.plural}/status", "patch")]
            elif verb == "scale":  # the scale subresource, read and merge-patched
                granted = [(f"{kind.plural}/scale", "get"), (f"{kind.plural}/scale", "patch")]
            elif verb == "watch":
                granted = [(kind.plural, "list"), (kind.plural, "watch")]
            else:
                granted = [(kind.plural, verb)]
            rules.update((kind.group, resource, v) for resource, v in granted)
    return rules


def _walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


@pytest.mark.parametrize(("kind", "own_namespace"), [("ClusterRole", False), ("Role", True)])
def test_the_roles_grant_exactly_the_calls_the_client_makes(kind, own_namespace):
    role = _one(kind)
    if own_namespace:
        assert role["metadata"]["namespace"] == NAMESPACE
    granted = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "no resourceNames, no URLs"
        granted.update(
            (group, resource, verb)
            for group in rule["apiGroups"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        )
    expected = _derived_rules(own_namespace)
    assert granted == expected, (
        f"missing: {sorted(expected - granted)}; not in CALLS: {sorted(granted - expected)}"
    )
    assert not any("*" in str(value) for value in _walk(role["rules"]))


def test_the_binding_gives_the_role_to_the_deployments_service_account():
    binding = _one("ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": _one("ClusterRole")["metadata"]["name"],
    }
    account = _one("ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    pod = _one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


# --- the CRD -------------------------------------------------------------------------------


def _crd() -> dict[str, Any]:
    return _one("CustomResourceDefinition", "functions.gitops-sless.dev")


def _version() -> dict[str, Any]:
    versions = _crd()["spec"]["versions"]
    assert [v["name"] for v in versions] == ["v1alpha1"]
    return versions[0]


def _schema() -> dict[str, Any]:
    return _version()["schema"]["openAPIV3Schema"]


def test_the_crd_is_the_function_kind_the_client_uses():
    spec = _crd()["spec"]
    kind = KINDS["Function"]
    assert spec["group"] == kind.group
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "Function",
        "listKind": "FunctionList",
        "plural": kind.plural,
        "singular": "function",
        "shortNames": ["fn"],
        "categories": ["gitops-sless"],
    }
    version = _version()
    assert (version["name"], version["served"], version["storage"]) == (kind.version, True, True)
    assert version["subresources"] == {"status": {}}
    assert _schema()["required"] == ["spec"]


def test_the_crd_prints_six_columns():
    columns = {
        c["name"]: (c["type"], c["jsonPath"]) for c in _version()["additionalPrinterColumns"]
    }
    assert columns == {
        "Phase": ("string", ".status.phase"),
        "Runtime": ("string", ".spec.runtime"),
        "Tag": ("string", ".status.buildTag"),
        "Revision": ("string", ".status.revision"),
        "URL": ("string", ".status.url"),
        "Age": ("date", ".metadata.creationTimestamp"),
    }
    revision = next(c for c in _version()["additionalPrinterColumns"] if c["name"] == "Revision")
    assert "commit" in revision["description"]


def _schema_nodes(node: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node below ``node``, with its path."""
    yield where or ".", node
    for name, child in (node.get("properties") or {}).items():
        yield from _schema_nodes(child, f"{where}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _schema_nodes(node["items"], f"{where}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schema_nodes(node["additionalProperties"], f"{where}{{}}")


def test_the_crd_schema_is_structural_and_described():
    for where, node in _schema_nodes(_schema()):
        assert "type" in node, f"{where}: every node of a structural schema has a type"
        assert not {"$ref", "allOf", "anyOf", "oneOf", "not"} & set(node), where
        if node["type"] == "object" and where != ".metadata":
            assert (
                node.get("properties")
                or node.get("additionalProperties")
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), f"{where}: an object says what it holds"
        if where not in (".apiVersion", ".kind", ".metadata"):
            assert node.get("description"), f"{where}: no description"


def test_the_crd_schema_has_the_functions_fields():
    props = _schema()["properties"]
    assert set(props["spec"]["properties"]) == {
        *("runtime", "entrypoint", "memoryMB", "timeoutSec", "replicas", "enabled", "http"),
        *("crons", "env", "jobs", "buildTag", "manifest", "folder", "environment"),
        *("async", "subjects"),
    }
    status = props["status"]["properties"]
    assert set(status) == {
        *("phase", "message", "buildTag", "image", "revision", "url", "updated", "restarts"),
        *("lastExit", "observedGeneration", "jobs", "conditions"),
        *("servingRevision", "pinned", "traffic"),
    }
    assert status["phase"]["enum"] == [
        "Pending",
        "Building",
        "Ready",
        "Idle",
        "Progressing",
        "RolledBack",
        "Failed",
        "Invalid",
        "Disabled",
    ]
    assert status["jobs"]["maxItems"] == 20
    assert status["jobs"]["items"]["properties"]["result"]["maxLength"] == 1024


def test_status_conditions_have_the_standard_condition_shape():
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["type"] == "array"
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert set(item["required"]) == {"type", "status", "reason", "message", "lastTransitionTime"}
    props = item["properties"]
    assert set(props) == set(item["required"]) | {"observedGeneration"}
    assert props["status"]["enum"] == ["True", "False", "Unknown"]
    assert (props["lastTransitionTime"]["type"], props["lastTransitionTime"]["format"]) == (
        "string",
        "date-time",
    )
    assert (props["observedGeneration"]["type"], props["observedGeneration"]["format"]) == (
        "integer",
        "int64",
    )


def test_an_env_value_holds_a_secrets_name_never_its_value():
    env = _schema()["properties"]["spec"]["properties"]["env"]
    value = env["additionalProperties"]
    assert value["type"] == "object"
    assert {name: p["type"] for name, p in value["properties"].items()} == {
        "value": "string",  # a literal from the manifest, never a secret's content
        "secret": "string",
        "key": "string",
        "job": "string",
    }
    # no field below env keeps what the schema does not name: anything else is pruned
    assert not any(
        "x-kubernetes-preserve-unknown-fields" in node or "additionalProperties" in node
        for _, node in _schema_nodes(value)
    )
    rules = " ".join(r["rule"] for r in value["x-kubernetes-validations"])
    assert "has(self.secret) == has(self.key)" in rules  # a secret is a (name, key) pair
    assert "== 1" in rules  # and never comes with a value


def _function(**status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "gitops-sless.dev/v1alpha1",
        "kind": "Function",
        "metadata": {"name": "hello", "namespace": "sless-prod"},
        "spec": {
            "runtime": "python3.11",
            "entrypoint": "main.handler",
            "memoryMB": 128,
            "timeoutSec": 30,
            "replicas": 1,
            "enabled": True,
            "http": True,
            "crons": [{"schedule": "*/5 * * * *", "event": {"any": {"thing": [1]}}}],
            "env": {"GREETING": {"value": "hi"}, "TOKEN": {"secret": "api", "key": "token"}},
            "jobs": [{"name": "migrate", "runId": 2, "event": {}}],
            "buildTag": "b-0123456789ab",
            "manifest": "greeting/python/sless.yaml",
            "folder": "greeting/python",
            "environment": "prod",
        },
        "status": {"phase": "Ready", "observedGeneration": 1, **status},
    }


def test_the_crd_schema_accepts_a_function_and_refuses_an_unknown_phase():
    validator = jsonschema.Draft7Validator(_schema())
    assert not list(validator.iter_errors(_function()))
    assert list(validator.iter_errors(_function(phase="Sleeping")))
    assert list(validator.iter_errors(_function(jobs=[{"name": "j"}] * 21)))


# --- the Deployment ------------------------------------------------------------------------


def _container() -> dict[str, Any]:
    containers = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _pinned(image: str) -> bool:
    """A tag with a version number (or a digest); never latest, never untagged."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and re.search(r"\d", tag) is not None


def test_the_deployment_runs_two_replicas_spread_over_nodes():
    deployment = _one("Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    spread = [c["topologyKey"] for c in pod.get("topologySpreadConstraints", [])]
    affinity = pod.get("affinity", {}).get("podAntiAffinity", {})
    assert "kubernetes.io/hostname" in spread or affinity


def test_the_deployment_serves_the_kubernetes_backend_from_a_pinned_image():
    container = _container()
    assert _pinned(container["image"]), container["image"]
    args = container["args"]
    assert args[:3] == ["serve", "--backend", "kubernetes"]
    assert args[args.index("--listen") + 1] == "0.0.0.0:8080"
    assert args[args.index("--state-dir") + 1] == "/var/cache/gitops-sless"
    assert "--repo=$(SLESS_REPO)" in args
    assert "SLESS_REPO" in _one("ConfigMap", "gitops-sless-config")["data"]
    assert container["envFrom"] == [
        {"configMapRef": {"name": "gitops-sless-config"}},
        {"secretRef": {"name": "gitops-sless-secrets"}},
    ]
    from_fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert from_fields == {
        "SLESS_NAMESPACE": "metadata.namespace",
        "POD_NAME": "metadata.name",
        "POD_IP": "status.podIP",
    }


def test_the_deployment_runs_as_non_root_with_a_read_only_root():
    pod = _one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert "fsGroup" in pod["securityContext"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = _container()["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    # what it writes goes to emptyDirs: the state folder and /tmp
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in _container()["volumeMounts"]}
    for path in ("/var/cache/gitops-sless", "/tmp"):
        assert "emptyDir" in volumes[mounts[path]], path


def test_the_deployment_has_requests_limits_and_probes():
    container = _container()
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert container["resources"]["limits"] == {"memory": "512Mi"}
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_the_service_and_the_budget_select_the_deployments_pods():
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _one("Service")["spec"]
    assert service["type"] == "ClusterIP"
    assert service["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    budget = _one("PodDisruptionBudget")["spec"]
    assert budget["minAvailable"] == 1
    for selector in (service["selector"], budget["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert _one("Deployment")["spec"]["selector"]["matchLabels"].items() <= labels.items()


# --- the Dockerfile ------------------------------------------------------------------------


@cache
def _instructions() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    found, pending = [], ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation"
    return tuple(found)


def _args(instruction: str) -> list[str]:
    return [rest for keyword, rest in _instructions() if keyword == instruction]


def _shell_words(text: str) -> list[str]:
    return shlex.split(text)


def test_every_base_image_is_pinned():
    bases = _args("FROM")
    assert len(bases) >= 2, "a builder stage and a runtime stage"
    images = []
    for rest in bases:
        words = [w for w in rest.split() if not w.startswith("--")]
        images.append(words[0])
        assert _pinned(words[0]), f"FROM {words[0]}: pin an exact version"
    assert len(set(images)) == 1, "the builder and the runtime share one pinned base"


def test_the_image_runs_gitops_sless_serve_as_a_non_root_user():
    keywords = [keyword for keyword, _ in _instructions()]
    entrypoint_at = keywords.index("ENTRYPOINT")
    users = [rest for keyword, rest in _instructions()[:entrypoint_at] if keyword == "USER"]
    assert users, "no USER before ENTRYPOINT"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), "runs as root"
    (entrypoint,) = _args("ENTRYPOINT")
    (cmd,) = _args("CMD")
    command = json.loads(entrypoint) + json.loads(cmd)  # exec form
    assert command[:2] == ["gitops-sless", "serve"]
    assert json.loads(cmd) == ["serve", "--backend", "kubernetes"]
    # the Deployment's args replace CMD and keep the entrypoint: still gitops-sless serve
    assert _container()["args"][0] == "serve"
    assert "8080" in " ".join(_args("EXPOSE")).split()


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context."""
    found = []
    for rest in _args("COPY"):
        words = _shell_words(rest)
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        found.append((words[:-1], words[-1]))
    return found


def test_every_copy_source_is_in_the_repository_and_the_build_context():
    ignored = [p for p in _dockerignore() if not p.startswith("!")]
    for sources, _ in _copies():
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            top = source.rstrip("/").split("/")[0]
            assert not any(fnmatch.fnmatch(top, p) for p in ignored), f"{source} is ignored"
    for needed in (".venv", ".git", "tests", "bench", "test-artifacts", ".sless-state"):
        assert needed in _dockerignore()


def test_the_wheel_is_built_from_what_pyproject_needs():
    copied = {source.rstrip("/") for sources, _ in _copies() for source in sources}
    assert {"pyproject.toml", "README.md", "gitops_sless"} <= copied
    assert any("pip wheel" in rest for rest in _args("RUN"))


def test_the_data_folders_are_where_the_code_looks(monkeypatch):
    env = " ".join(_args("ENV"))
    match = re.search(r"\bSLESS_HOME=(\S+)", env)
    assert match, "ENV SLESS_HOME: the wheel does not carry schemas/, templates/, runtimes/"
    home = match.group(1)
    destinations = {dest.rstrip("/"): sources for sources, dest in _copies()}
    for folder in ("runtimes", "templates", "schemas"):
        assert destinations.get(f"{home}/{folder}") == [folder], f"COPY {folder} {home}/{folder}"
    monkeypatch.setenv("SLESS_HOME", home)
    assert paths.runtimes_dir() == Path(home) / "runtimes"
    assert paths.templates_dir() == Path(home) / "templates"
    assert paths.schema_path() == Path(home) / "schemas" / "sless.schema.json"


def test_apt_installs_git_only():
    installs = []
    for rest in _args("RUN"):
        for command in re.split(r"&&|;|\|\|", rest):
            words = _shell_words(command)
            if words[:1] == ["apt-get"] and "install" in words:
                installs.append(words)
    assert installs, "git is installed with apt-get"
    for words in installs:
        packages = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
        assert packages == ["git"]
        assert "--no-install-recommends" in words
    assert any("rm -rf /var/lib/apt/lists" in rest for rest in _args("RUN"))


def test_the_role_binding_gives_the_namespaced_role_to_the_same_account():
    binding = _one("RoleBinding")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": _one("Role")["metadata"]["name"],
    }
    account = _one("ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]


# --- deploy/restrict: the ValidatingAdmissionPolicy component ------------------------------

RESTRICT = DEPLOY / "restrict"
POLICY_NAME = "gitops-sless-managed-namespaces-only"
ACCOUNT = f"system:serviceaccount:{NAMESPACE}:gitops-sless"
MANAGED = {"app.kubernetes.io/managed-by": "gitops-sless"}


@cache
def _restrict_objects() -> tuple[dict[str, Any], ...]:
    component = yaml.safe_load((RESTRICT / "kustomization.yaml").read_text(encoding="utf-8"))
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert component["kind"] == "Component"
    found = []
    for name in component["resources"]:
        text = (RESTRICT / name).read_text(encoding="utf-8")
        found.extend(obj for obj in yaml.safe_load_all(text) if obj)
    return tuple(found)


def _restrict(kind: str) -> dict[str, Any]:
    (obj,) = [o for o in _restrict_objects() if o["kind"] == kind]
    return obj


def test_the_restrict_component_is_a_policy_and_its_binding_valid_in_1_30():
    assert {o["kind"] for o in _restrict_objects()} == {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    listed = {p.name for p in RESTRICT.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == set(yaml.safe_load((RESTRICT / "kustomization.yaml").read_text())["resources"])
    for obj in _restrict_objects():
        kubernetes_validate.validate(obj, "1.30", strict=True)
        assert obj["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert "namespace" not in obj["metadata"], "cluster-scoped"
    binding = _restrict("ValidatingAdmissionPolicyBinding")["spec"]
    assert binding == {"policyName": POLICY_NAME, "validationActions": ["Deny"]}
    policy = _restrict("ValidatingAdmissionPolicy")
    assert policy["metadata"]["name"] == POLICY_NAME
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    assert rule["resources"] == ["*", "*/*"] and rule["scope"] == "*"


def test_the_policy_names_the_shipped_account_namespaces_and_label():
    from gitops_sless.kube.renderer import MANAGED_BY
    from gitops_sless.kube.settings import KubeSettings

    account = _one("ServiceAccount")["metadata"]
    assert f"system:serviceaccount:{account['namespace']}:{account['name']}" == ACCOUNT
    assert _admit(_request("CREATE", "deployments", "kube-system", user=ACCOUNT), {}) != "skipped"
    variables = {
        v["name"]: v["expression"]
        for v in _restrict("ValidatingAdmissionPolicy")["spec"]["variables"]
    }
    assert variables["label"] == repr(MANAGED_BY)
    untrusted = KubeSettings.__dataclass_fields__["untrusted_namespace"].default
    assert variables["ownNamespaces"] == repr([NAMESPACE, untrusted])


def _cel(expression: str, activation: dict[str, Any]) -> Any:
    """The value of a CEL expression, or the CELEvalError it evaluates to (as a value: CEL's
    || and && absorb an error when the other side decides, as the API server's cel-go does)."""
    environment = celpy.Environment()
    try:
        return environment.program(environment.compile(expression)).evaluate(activation)
    except CELEvalError as exc:
        return exc


def _admit(
    request: dict[str, Any],
    obj: dict[str, Any] | None = None,
    old: dict[str, Any] | None = None,
    namespace: dict[str, Any] | None = None,
) -> str:
    """What the API server does with ``request`` under the policy: skipped (the match
    conditions leave it out), allowed, or denied with the policy's message."""
    spec = _restrict("ValidatingAdmissionPolicy")["spec"]
    values = {"request": request, "object": obj, "oldObject": old, "namespaceObject": namespace}
    activation = {name: celpy.json_to_cel(value) for name, value in values.items()}
    for condition in spec["matchConditions"]:
        if not _cel(condition["expression"], activation):
            return "skipped"
    variables: dict[Any, Any] = {}
    for variable in spec["variables"]:  # each sees the ones before it
        activation["variables"] = celtypes.MapType(variables)
        variables[celtypes.StringType(variable["name"])] = _cel(variable["expression"], activation)
    activation["variables"] = celtypes.MapType(variables)
    for validation in spec["validations"]:
        verdict = _cel(validation["expression"], activation)
        assert not isinstance(verdict, CELEvalError), f"{validation['expression']}: {verdict}"
        if not verdict:
            return f"denied: {_cel(validation['messageExpression'], activation)}"
    return "allowed"


def _request(
    operation: str, resource: str, namespace: str = "", name: str = "x", user: str = ACCOUNT
) -> dict[str, Any]:
    group = {"deployments": "apps", "leases": "coordination.k8s.io", "clusterroles": "rbac"}
    return {
        "operation": operation,
        "name": name,
        # the API server gives a Namespace's own name as the request's namespace
        "namespace": name if resource == "namespaces" and operation != "CREATE" else namespace,
        "resource": {"group": group.get(resource, ""), "version": "v1", "resource": resource},
        "userInfo": {"username": user, "groups": ["system:serviceaccounts"]},
    }


def _ns(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name, **labels}}}


@pytest.mark.parametrize(
    ("operation", "resource", "where", "verdict"),
    [
        pytest.param("CREATE", "deployments", _ns("sless-prod", **MANAGED), "allowed", id="env"),
        pytest.param("UPDATE", "secrets", _ns("sless-pr-3", **MANAGED), "allowed", id="env-patch"),
        pytest.param("DELETE", "services", _ns("sless-prod", **MANAGED), "allowed", id="env-del"),
        pytest.param("CREATE", "leases", _ns(NAMESPACE), "allowed", id="own-namespace"),
        pytest.param("CREATE", "jobs", _ns("gitops-sless-untrusted"), "allowed", id="untrusted"),
        pytest.param("CREATE", "deployments", _ns("kube-system"), "denied", id="kube-system"),
        pytest.param("UPDATE", "secrets", _ns("team-a"), "denied", id="other-team-patch"),
        pytest.param("DELETE", "secrets", _ns("team-a"), "denied", id="other-team-delete"),
        pytest.param(
            "CREATE",
            "deployments",
            _ns("helm", **{"app.kubernetes.io/managed-by": "Helm"}),
            "denied",
            id="managed-by-someone-else",
        ),
        pytest.param("CREATE", "clusterroles", None, "denied", id="cluster-scoped"),
    ],
)
def test_the_reconciler_writes_only_in_namespaces_it_manages(operation, resource, where, verdict):
    namespace = where["metadata"]["name"] if where else ""
    request = _request(operation, resource, namespace)
    body = None if operation == "DELETE" else {"metadata": {"name": "x"}}
    old = None if operation == "CREATE" else {"metadata": {"name": "x"}}
    said = _admit(request, body, old, where)
    assert said.split(":")[0] == verdict, said
    if verdict == "denied":
        assert "app.kubernetes.io/managed-by=gitops-sless" in said
        assert (namespace or "cluster-scoped") in said


@pytest.mark.parametrize(
    ("operation", "old", "new", "verdict"),
    [
        pytest.param("CREATE", None, _ns("sless-pr-9", **MANAGED), "allowed", id="create-labelled"),
        pytest.param("CREATE", None, _ns("sless-pr-9"), "denied", id="create-unlabelled"),
        pytest.param(
            "UPDATE",
            _ns("sless-prod", **MANAGED),
            _ns("sless-prod", **MANAGED),
            "allowed",
            id="update-managed",
        ),
        pytest.param("UPDATE", _ns("team-a"), _ns("team-a", **MANAGED), "denied", id="take-over"),
        pytest.param(
            "UPDATE", _ns("sless-prod", **MANAGED), _ns("sless-prod"), "denied", id="drop-the-label"
        ),
        pytest.param("DELETE", _ns("sless-pr-9", **MANAGED), None, "allowed", id="delete-managed"),
        pytest.param("DELETE", _ns("kube-system"), None, "denied", id="delete-kube-system"),
    ],
)
def test_the_reconciler_creates_and_deletes_only_labelled_namespaces(operation, old, new, verdict):
    name = (new or old)["metadata"]["name"]
    said = _admit(_request(operation, "namespaces", name=name), new, old)
    assert said.split(":")[0] == verdict, said
    if verdict == "denied":
        assert f"{name} is not" in said


@pytest.mark.parametrize(
    "user",
    [
        "kubernetes-admin",
        "system:serviceaccount:kube-system:namespace-controller",
        "system:serviceaccount:other:gitops-sless",  # same name, another namespace
    ],
)
def test_writes_by_anyone_else_are_not_looked_at(user):
    request = _request("DELETE", "namespaces", name="kube-system", user=user)
    assert _admit(request, None, _ns("kube-system")) == "skipped"
    request = _request("CREATE", "deployments", "kube-system", user=user)
    assert _admit(request, {}, None, _ns("kube-system")) == "skipped"


def test_kubectl_builds_deploy_and_an_overlay_with_the_restrict_component(tmp_path: Path) -> None:
    """What an admin runs: `kubectl apply -k deploy/`, and an overlay adding deploy/restrict."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "scripts/setup --tests installs kubectl"
    plain = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True, check=True
    )
    kinds = {doc["kind"] for doc in yaml.safe_load_all(plain.stdout) if doc}
    assert {"Deployment", "NetworkPolicy", "ClusterRole"} <= kinds
    assert "ValidatingAdmissionPolicy" not in kinds
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    shutil.copytree(DEPLOY, overlay / "deploy")
    (overlay / "kustomization.yaml").write_text(
        "resources: [deploy]\ncomponents: [deploy/restrict]\n", encoding="utf-8"
    )
    restricted = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True
    )
    objects = [doc for doc in yaml.safe_load_all(restricted.stdout) if doc]
    kinds = [doc["kind"] for doc in objects]
    assert "ValidatingAdmissionPolicy" in kinds and "ValidatingAdmissionPolicyBinding" in kinds
    assert len(objects) == len([d for d in yaml.safe_load_all(plain.stdout) if d]) + 2


# --- deploy/nats: NATS JetStream for asynchronous invocations ------------------------------

NATS = DEPLOY / "nats"


@cache
def _nats_component() -> dict[str, Any]:
    return yaml.safe_load((NATS / "kustomization.yaml").read_text(encoding="utf-8"))


@cache
def _nats_objects() -> tuple[dict[str, Any], ...]:
    found = []
    for name in _nats_component()["resources"]:
        text = (NATS / name).read_text(encoding="utf-8")
        found.extend(obj for obj in yaml.safe_load_all(text) if obj)
    return tuple(found)


def _nats(kind: str) -> dict[str, Any]:
    (obj,) = [o for o in _nats_objects() if o["kind"] == kind]
    return obj


def _nats_patch(kind: str) -> Any:
    """The component's patch of the base's ``kind``: a strategic merge patch (an object)
    or a JSON 6902 patch (a list of operations)."""
    for patch in _nats_component()["patches"]:
        body = yaml.safe_load(patch["patch"])
        target = patch.get("target", {}).get("kind") or body.get("kind")
        if target == kind:
            return body
    raise AssertionError(f"deploy/nats patches no {kind}")


def test_the_nats_component_is_a_statefulset_a_service_and_a_policy_valid_in_1_30():
    component = _nats_component()
    assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert component["kind"] == "Component"
    listed = {p.name for p in NATS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == set(component["resources"])
    assert sorted(o["kind"] for o in _nats_objects()) == ["NetworkPolicy", "Service", "StatefulSet"]
    for obj in _nats_objects():
        kubernetes_validate.validate(obj, "1.30", strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE


def test_nats_runs_the_official_image_pinned_with_jetstream_on_a_volume_claim():
    statefulset = _nats("StatefulSet")["spec"]
    pod = statefulset["template"]["spec"]
    (container,) = pod["containers"]
    assert re.fullmatch(r"nats:2\.(1[1-9]|[2-9][0-9])\.[0-9]+-alpine", container["image"]), (
        "the official image, a NATS 2.11 or later release pinned by its full version"
    )
    args = container["args"]
    assert "--jetstream" in args and "--port=4222" in args
    (store,) = [a.split("=", 1)[1] for a in args if a.startswith("--store_dir=")]
    (claim,) = statefulset["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert {"name": claim["metadata"]["name"], "mountPath": store} in container["volumeMounts"]
    assert not pod.get("volumes"), "the store is the claim, never an emptyDir"
    assert not [a for a in args if a.startswith(("--config", "-c"))], "not the image's config"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["limits"]["memory"]


def test_the_queue_url_names_the_nats_service_and_serve_takes_it():
    from gitops_sless.serve.queue import queue_refusal

    service = _nats("Service")
    assert service["spec"]["selector"] == _nats("StatefulSet")["spec"]["selector"]["matchLabels"]
    (port,) = service["spec"]["ports"]
    config = _nats_patch("ConfigMap")
    assert _one("ConfigMap", config["metadata"]["name"])["metadata"]["namespace"] == NAMESPACE
    url = config["data"]["SLESS_QUEUE"]
    assert url == f"nats://{service['metadata']['name']}.{NAMESPACE}:{port['port']}"
    assert port["port"] == 4222
    assert queue_refusal(url, "kubernetes") is None


def test_only_the_reconcilers_pods_may_connect_to_nats():
    policy = _nats("NetworkPolicy")["spec"]
    assert policy["podSelector"] == _nats("StatefulSet")["spec"]["selector"]
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    reconciler = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}, "pods of this namespace only, no namespaceSelector"
    assert source["podSelector"]["matchLabels"].items() <= reconciler.items()
    assert rule["ports"] == [{"protocol": "TCP", "port": 4222}]


def test_every_replica_reads_the_callback_secrets_from_one_secret():
    from gitops_sless.invocations.callbacks import SECRET_NAME

    operations = {op["path"]: op["value"] for op in _nats_patch("Deployment")}
    (arg,) = [v for p, v in operations.items() if p.endswith("/args/-")]
    secrets_dir = arg.removeprefix("--secrets-dir=")
    mount = operations["/spec/template/spec/containers/0/volumeMounts/-"]
    assert mount["mountPath"] == f"{secrets_dir}/{SECRET_NAME}" and mount["readOnly"]
    volume = operations["/spec/template/spec/volumes/-"]
    assert volume["name"] == mount["name"]
    assert volume["secret"]["optional"] is True  # the pods start without it


def test_kubectl_builds_an_overlay_with_the_nats_and_restrict_components(tmp_path: Path) -> None:
    """What docs/install.md shows: an overlay of deploy/ with deploy/nats (and restrict)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "scripts/setup --tests installs kubectl"
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    shutil.copytree(DEPLOY, overlay / "deploy")
    (overlay / "kustomization.yaml").write_text(
        "resources: [deploy]\ncomponents: [deploy/restrict, deploy/nats]\n", encoding="utf-8"
    )
    built = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True
    )
    objects = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.30", strict=True)
    by_id = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert ("StatefulSet", "nats") in by_id and ("NetworkPolicy", "nats") in by_id
    assert ("ValidatingAdmissionPolicy", POLICY_NAME) in by_id
    config = by_id["ConfigMap", "gitops-sless-config"]["data"]
    assert config["SLESS_QUEUE"] == f"nats://nats.{NAMESPACE}:4222"
    assert config["SLESS_REPO"], "the base's settings are kept"
    pod = by_id["Deployment", "gitops-sless"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:2] == ["serve", "--backend"], "the base's arguments are kept"
    assert "--secrets-dir=/etc/gitops-sless/secrets" in container["args"]
    assert {v["name"] for v in pod["volumes"]} == {"state", "tmp", "callback-secrets"}
