"""The NetworkPolicies: what each environment and the reconciler's namespace let in and out.

The objects are checked against the Kubernetes 1.30 schemas, then evaluated (tests/
netpolicy_eval.py) for the connections that matter: the reconciler's proxy, build pods,
functions of the same and of other environments, DNS, cloud metadata, the outside.
The test API server stores NetworkPolicies but enforces none; a CNI that implements
them does.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gitops_sless.kube import renderer
from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.renderer import MANAGED_BY, RenderConfig
from gitops_sless.kube.settings import KubeSettings, StartupError
from gitops_sless.manifests import load as manifest
from gitops_sless.source.snapshot import DirectorySnapshot

from ..kubeapi import FakeKube
from ..netpolicy_eval import Endpoint, connects, outside, pod
from ..paths import ROOT
from ..test_serve_start import serve as serve_command

K8S_VERSION = "1.30.0"
CONTROLLER = "gitops-sless"
UNTRUSTED = "gitops-sless-untrusted"
MANAGED = {MANAGED_BY: "gitops-sless"}
FUNCTION_PORT = renderer.CONTAINER_PORT
# what KubeSettings needs besides the settings under test
BASE_ENV = {"SLESS_NAMESPACE": "ops", "SLESS_S3_ENDPOINT": "http://s3.test", "SLESS_S3_BUCKET": "c"}


@cache
def _deployed(kind: str, name: str = "gitops-sless") -> dict[str, Any]:
    for path in (ROOT / "deploy").glob("*.yaml"):
        for obj in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if obj and obj["kind"] == kind and obj["metadata"]["name"] == name:
                return obj
    raise AssertionError(f"no {kind}/{name} in deploy/")


def _reconciler() -> Endpoint:
    """A reconciler pod as deploy/deployment.yaml makes it."""
    labels = _deployed("Deployment")["spec"]["template"]["metadata"]["labels"]
    return pod(CONTROLLER, labels, **_deployed("Namespace")["metadata"]["labels"])


@cache
def _build_pod_labels() -> tuple[tuple[str, Any], ...]:
    """(namespace, pod labels) of every build Job the renderer makes for the sample."""
    state = manifest.load(DirectorySnapshot(ROOT / "sample-repo"))
    rendered = renderer.render_environment(state, "prod", job_results={}, builds=True)
    # a build Job runs outside the environment's namespace (function pods name their build too)
    builds = [
        (o["metadata"]["namespace"], o["spec"]["template"]["metadata"]["labels"])
        for o in rendered.objects
        if o["kind"] == "Job" and o["metadata"]["namespace"] != RenderConfig().namespace("prod")
    ]
    assert builds, "the sample renders build Jobs"
    return tuple(builds)


def _function(env: str, name: str = "greet") -> Endpoint:
    labels = {"app.kubernetes.io/name": name, **MANAGED, "gitops-sless.dev/function": name}
    return pod(f"sless-{env}", labels, **MANAGED, **{renderer.ENV_LABEL: env})


def _policies(*envs: str, config: RenderConfig | None = None) -> list[dict[str, Any]]:
    config = config or RenderConfig()
    objects = [o for env in envs for o in renderer.environment_objects(env, config)]
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


def _all_policies(config: RenderConfig | None = None) -> list[dict[str, Any]]:
    return [*_policies("prod", "pr-7", "pr-8", config=config), _deployed("NetworkPolicy")]


KUBE_DNS = pod("kube-system", {"k8s-app": "kube-dns"})
INGRESS_CONTROLLER = pod("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})
METADATA = outside("169.254.169.254")
EXTERNAL = outside("203.0.113.7")


# --- the objects ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "egress",
    [
        pytest.param((), id="no-egress-cidrs"),
        pytest.param(("0.0.0.0/0", "::/0"), id="everything"),
        pytest.param(("10.20.0.0/16", "169.254.20.10/32", "2001:db8::/32"), id="some"),
    ],
)
@pytest.mark.parametrize("env", ["prod", "pr-12"])
def test_every_rendered_policy_is_strict_valid(env, egress):
    config = RenderConfig(preview_egress=egress)
    for obj in renderer.environment_objects(env, config):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["metadata"]["labels"][MANAGED_BY] == "gitops-sless"
        assert obj["metadata"]["annotations"][renderer.SPEC_HASH] == renderer.spec_hash(obj)


def test_production_has_an_ingress_policy_and_previews_an_egress_one_too():
    assert [p["metadata"]["name"] for p in _policies("prod")] == ["sless-ingress"]
    assert [p["metadata"]["name"] for p in _policies("pr-3")] == ["sless-ingress", "sless-egress"]
    for policy in _policies("pr-3"):
        assert policy["spec"]["podSelector"] == {}, "every pod of the environment"


def test_the_default_reconciler_labels_are_those_of_the_shipped_deployment():
    deployed = _deployed("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert dict(RenderConfig().reconciler_labels).items() <= deployed.items()


def test_the_test_api_server_takes_the_policies_by_server_side_apply(fake_kube: FakeKube):
    client = KubeClient.from_config(str(fake_kube.kubeconfig))
    config = RenderConfig(preview_egress=("198.51.100.0/24",))
    for obj in renderer.environment_objects("pr-4", config):
        client.apply(obj)
    stored = {p["metadata"]["name"]: p for p in fake_kube.objects("NetworkPolicy", "sless-pr-4")}
    assert set(stored) == {"sless-ingress", "sless-egress"}
    assert stored["sless-egress"]["spec"]["egress"][-1] == {
        "to": [{"ipBlock": {"cidr": "198.51.100.0/24"}}]
    }


# --- function namespaces: ingress ----------------------------------------------------------


def test_the_reconciler_reaches_every_environments_functions_on_their_port_only():
    policies = _all_policies()
    for env in ("prod", "pr-7"):
        assert connects(policies, _reconciler(), _function(env))
        assert not connects(policies, _reconciler(), _function(env), port=9090)


def test_build_pods_reach_no_function():
    policies = _all_policies()
    for namespace, labels in _build_pod_labels():
        build = pod(namespace, labels)
        for env in ("prod", "pr-7"):
            assert not connects(policies, build, _function(env)), (namespace, labels)


def test_pods_of_the_controller_or_untrusted_namespace_need_the_reconcilers_labels():
    policies = _all_policies()
    other = pod(CONTROLLER, {"app.kubernetes.io/name": "something-else"})
    assert not connects(policies, other, _function("prod"))
    # labels are not enough in another namespace: an untrusted build may wear any
    impostor = pod(UNTRUSTED, dict(RenderConfig().reconciler_labels))
    assert not connects(policies, impostor, _function("prod"))


def test_functions_reach_each_other_within_their_environment_only():
    policies = _all_policies()
    assert connects(policies, _function("prod", "a"), _function("prod", "b"))
    assert connects(policies, _function("pr-7", "a"), _function("pr-7", "b"), port=5432)
    assert not connects(policies, _function("pr-7"), _function("prod"))
    assert not connects(policies, _function("prod"), _function("pr-7"))
    assert not connects(policies, _function("pr-8"), _function("pr-7"))
    assert not connects(policies, INGRESS_CONTROLLER, _function("prod"))


def test_configured_reconciler_labels_are_the_ones_admitted():
    config = KubeSettings.from_env(
        {**BASE_ENV, "SLESS_RECONCILER_LABELS": "app=sless, tier=control"}
    ).render_config()
    policies = _policies("prod", config=config)
    reconciler = pod("ops", {"app": "sless", "tier": "control"})
    assert connects(policies, reconciler, _function("prod"))
    assert not connects(policies, pod("ops", {"app": "sless"}), _function("prod"))
    assert not connects(policies, _reconciler(), _function("prod"))  # another namespace


def test_with_a_gateway_its_namespace_reaches_the_functions_port_only():
    envoy = pod("envoy-gateway-system", {"app.kubernetes.io/name": "envoy"})
    assert not connects(_all_policies(), envoy, _function("prod"))
    config = KubeSettings.from_env({**BASE_ENV, "SLESS_GATEWAY": "envoy-gateway-system/sless"})
    policies = _policies("prod", "pr-7", config=config.render_config())
    for env in ("prod", "pr-7"):
        assert connects(policies, envoy, _function(env))
        assert not connects(policies, envoy, _function(env), port=9090)
    # and no one else gains anything from it
    assert not connects(policies, INGRESS_CONTROLLER, _function("prod"))
    reconciler = pod("ops", dict(RenderConfig().reconciler_labels))  # SLESS_NAMESPACE=ops
    assert connects(policies, reconciler, _function("prod"))
    for obj in policies:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --- preview namespaces: egress ------------------------------------------------------------


def test_production_egress_stays_open():
    policies = _all_policies()
    for target in (EXTERNAL, METADATA, KUBE_DNS, INGRESS_CONTROLLER):
        assert connects(policies, _function("prod"), target, port=443)


def test_a_preview_resolves_names_and_reaches_nothing_else_by_default():
    policies = _all_policies()
    preview = _function("pr-7")
    assert connects(policies, preview, KUBE_DNS, port=53, protocol="UDP")
    assert connects(policies, preview, KUBE_DNS, port=53, protocol="TCP")
    assert not connects(policies, preview, KUBE_DNS, port=8080)
    assert not connects(policies, preview, pod("kube-system", {"k8s-app": "other"}), port=53)
    for target in (EXTERNAL, METADATA, outside("8.8.8.8"), INGRESS_CONTROLLER, _reconciler()):
        assert not connects(policies, preview, target, port=53, protocol="UDP")
        assert not connects(policies, preview, target, port=443)


def test_preview_egress_opens_the_listed_cidrs_but_never_cloud_metadata_by_a_wide_one():
    config = RenderConfig(preview_egress=("0.0.0.0/0",))
    policies = _all_policies(config)
    preview = _function("pr-7")
    assert connects(policies, preview, EXTERNAL, port=443)
    assert not connects(policies, preview, METADATA, port=80)
    assert not connects(policies, preview, outside("2001:db8::1"), port=443)  # IPv4 only
    # production still refuses previews: its ingress policy does not depend on egress
    assert not connects(policies, preview, _function("prod"))

    narrow = _all_policies(RenderConfig(preview_egress=("203.0.113.0/24", "169.254.169.254/32")))
    assert connects(narrow, preview, EXTERNAL, port=443)
    assert connects(narrow, preview, METADATA, port=80), "listed by name: the operator's choice"
    assert not connects(narrow, preview, outside("198.51.100.1"), port=443)


def test_preview_egress_is_read_normalised_and_deduplicated():
    settings = KubeSettings.from_env(
        {**BASE_ENV, "SLESS_PREVIEW_EGRESS": " 10.0.0.0/8,,2001:DB8::/32,10.0.0.0/8 "}
    )
    assert settings.preview_egress == ("10.0.0.0/8", "2001:db8::/32")
    assert settings.render_config().preview_egress == settings.preview_egress
    assert KubeSettings.from_env(BASE_ENV).preview_egress == ()


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        pytest.param(
            "SLESS_PREVIEW_EGRESS", "10.1.2.3", "'10.1.2.3' is not a CIDR", id="no-prefix"
        ),
        pytest.param("SLESS_PREVIEW_EGRESS", "10.1.2.3/8", "has host bits set", id="host-bits"),
        pytest.param("SLESS_PREVIEW_EGRESS", "10.0.0.0/33", "'10.0.0.0/33'", id="prefix-too-long"),
        pytest.param("SLESS_PREVIEW_EGRESS", "10.0.0.0/8,intranet/8", "'intranet/8'", id="name"),
        pytest.param("SLESS_RECONCILER_LABELS", "", "no labels", id="no-labels"),
        pytest.param("SLESS_RECONCILER_LABELS", "app", "'app' is not a label", id="no-value"),
        pytest.param("SLESS_RECONCILER_LABELS", "a b=c", "'a b=c' is not a label", id="bad-key"),
    ],
)
def test_a_bad_network_setting_is_a_one_line_start_up_error(variable, value, said):
    with pytest.raises(StartupError) as caught:
        KubeSettings.from_env({**BASE_ENV, variable: value})
    message = str(caught.value)
    assert message.startswith(f"{variable}: ") and said in message, message
    assert "\n" not in message


def test_serve_refuses_a_bad_cidr_before_it_contacts_anything(tmp_path):
    env = {
        "SLESS_S3_ENDPOINT": "http://127.0.0.1:9",
        "SLESS_S3_BUCKET": "contexts",
        "SLESS_PREVIEW_EGRESS": "10.0.0.0/8,10.1.2.3/8",
        "KUBECONFIG": str(tmp_path / "missing"),
    }
    done = serve_command(
        tmp_path,
        *("--backend", "kubernetes", "--repo", "https://git.example.invalid/team/functions.git"),
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "gitops-sless serve: SLESS_PREVIEW_EGRESS: '10.1.2.3/8' is not a CIDR "
        "(10.1.2.3/8 has host bits set)"
    ]


# --- the reconciler's own namespace (deploy/networkpolicy.yaml) -----------------------------


def test_clients_in_other_namespaces_reach_the_reconcilers_port_only():
    policies = _all_policies()
    monitoring = pod("monitoring", {"app": "prometheus"}, **{MANAGED_BY: "Helm"})
    for client in (INGRESS_CONTROLLER, monitoring):
        assert connects(policies, client, _reconciler(), port=8080)
        assert not connects(policies, client, _reconciler(), port=9090)


def test_build_pods_and_function_pods_cannot_reach_the_reconciler():
    policies = _all_policies()
    for namespace, labels in _build_pod_labels():
        assert not connects(policies, pod(namespace, labels), _reconciler()), namespace
    assert not connects(policies, pod(UNTRUSTED, {"any": "pod"}), _reconciler())
    for env in ("prod", "pr-7"):
        assert not connects(policies, _function(env), _reconciler())


def test_the_reconciler_policy_leaves_build_pods_egress_open():
    # kaniko pulls base images, fetches its context and pushes to the registry
    policies = _all_policies()
    for namespace, labels in _build_pod_labels():
        assert connects(policies, pod(namespace, labels), EXTERNAL, port=443)
    policy = _deployed("NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    labels = _deployed("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
