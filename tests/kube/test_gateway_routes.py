"""The Gateway API as the data plane (``--gateway NAMESPACE/NAME``).

Each http function also gets an HTTPRoute attached to the Gateway: the cluster's gateway
sends ``/fn/{env}/{name}/...`` straight to the function's Service, with the prefix
stripped, the proxy's ``X-Forwarded-Prefix`` and the function's timeout. Every rendered
route is checked against the Gateway API's published schema (``@kubernetes-models/
gateway-api``, through node); the test API server serves the kinds from tests/data/
gateway-api-crds.yaml and validates what is written against them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gitops_sless import cli
from gitops_sless.kube import renderer
from gitops_sless.kube.client import Invalid, KubeClient
from gitops_sless.kube.gateway import gateway_url
from gitops_sless.kube.renderer import RenderConfig
from gitops_sless.kube.settings import KubeSettings, StartupError
from gitops_sless.manifests import load as manifest
from gitops_sless.plan.backend import deployment_for
from gitops_sless.source.snapshot import DirectorySnapshot

from ..gateway_schema import assert_valid, schema_errors
from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, make, settings
from ..kubeapi import FakeKube
from ..paths import DATA, ROOT
from ..s3server import S3Server
from ..test_serve_start import serve as serve_command

CRDS = DATA / "gateway-api-crds.yaml"
GATEWAY = ("edge", "public")
PROD = "sless-prod"
BASE_ENV = {"SLESS_NAMESPACE": "ops", "SLESS_S3_ENDPOINT": "http://s3.test", "SLESS_S3_BUCKET": "c"}
HANDLER = "def handler(event, context):\n    return {'ok': True}\n"
JOB_RESULTS = {
    "get-time-py": '{"utc": "2026-11-30T00:00:00Z"}',
    "get-time-js": '{"utc": "2026-11-30T00:00:00Z"}',
}


def _sample(env: str = "prod", gateway: tuple[str, str] | None = GATEWAY) -> list[dict[str, Any]]:
    state = manifest.load(DirectorySnapshot(ROOT / "sample-repo"))
    config = RenderConfig(gateway=gateway)
    return renderer.render_environment(state, env, config, job_results=JOB_RESULTS).objects


def _routes(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "HTTPRoute"}


# --- what is rendered ----------------------------------------------------------------------


@pytest.mark.parametrize("env", ["prod", "pr-12"])
def test_every_rendered_route_is_valid_against_the_gateway_api_schema(env):
    routes = _routes(_sample(env))
    assert routes
    assert_valid(routes.values())


def test_the_schema_check_would_catch_a_bad_route():
    # guards the test above: the published schema really refuses a malformed route
    route = copy.deepcopy(next(iter(_routes(_sample()).values())))
    route["spec"]["rules"][0]["timeouts"]["request"] = "30 seconds"
    route["spec"]["rules"][0]["filters"][0]["urlRewrite"]["path"]["type"] = "ReplacePrefix"
    (error,) = schema_errors([route])
    assert error and "timeouts/request" in error and "path/type" in error


def test_every_http_function_gets_a_route_and_nothing_else_does():
    objects = _sample()
    http = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    assert set(_routes(objects)) == http
    for name, route in _routes(objects).items():
        assert route["metadata"]["namespace"] == PROD
        labels = route["metadata"]["labels"]
        assert labels[renderer.FUNCTION_LABEL] == name
        assert labels[renderer.MANAGED_BY] == "gitops-sless"
        assert route["metadata"]["annotations"][renderer.SPEC_HASH] == renderer.spec_hash(route)


def test_a_route_does_what_the_proxy_does():
    route = _routes(_sample("pr-12"))["notes-py"]
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["namespace"], parent["name"]) == ("Gateway", *GATEWAY)
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/fn/pr-12/notes-py"}}]
    rewrite, headers = rule["filters"]
    assert rewrite["urlRewrite"]["path"] == {
        "type": "ReplacePrefixMatch",
        "replacePrefixMatch": "/",
    }
    assert headers["requestHeaderModifier"]["set"] == [
        {"name": "X-Forwarded-Prefix", "value": "/fn/pr-12/notes-py"}
    ]
    timeout = manifest.load(DirectorySnapshot(ROOT / "sample-repo")).functions["notes-py"]
    assert rule["timeouts"] == {"request": f"{timeout.timeout_sec}s"}
    assert rule["backendRefs"] == [{"kind": "Service", "name": "notes-py", "port": 80}]


def test_without_a_gateway_nothing_is_routed():
    assert not _routes(_sample(gateway=None))
    fn = manifest.load(DirectorySnapshot(ROOT / "sample-repo")).functions["greeting-py"]
    deployment = deployment_for("prod", fn, {})
    plain = renderer.render_function(deployment, RenderConfig())
    assert [o["kind"] for o in plain] == ["Deployment", "Service"]
    routed = renderer.render_function(deployment, RenderConfig(gateway=GATEWAY))
    assert [o["kind"] for o in routed] == ["Deployment", "Service", "HTTPRoute"]
    # the count the view checks a function's objects against
    assert routed[0]["metadata"]["annotations"][renderer.OBJECT_COUNT] == "3"


# --- the setting ---------------------------------------------------------------------------


def test_the_gateway_is_read_from_the_environment_and_a_flag_wins():
    assert KubeSettings.from_env(BASE_ENV).render_config().gateway is None
    env = {**BASE_ENV, "SLESS_GATEWAY": "edge/public"}
    assert KubeSettings.from_env(env).render_config().gateway == ("edge", "public")
    assert KubeSettings.from_env(env, gateway="gw/other").gateway == ("gw", "other")


@pytest.mark.parametrize(
    ("value", "said"),
    [
        pytest.param("public", "'public' is not NAMESPACE/NAME", id="no-namespace"),
        pytest.param("edge/", "'edge/' is not NAMESPACE/NAME", id="no-name"),
        pytest.param("Edge/public", "namespace 'Edge' is not a DNS-1123 label", id="upper"),
        pytest.param("edge/a/b", "name 'a/b' is not a DNS-1123 subdomain", id="two-slashes"),
    ],
)
def test_a_bad_gateway_is_a_one_line_start_up_error(value, said):
    with pytest.raises(StartupError) as caught:
        KubeSettings.from_env({**BASE_ENV, "SLESS_GATEWAY": value})
    message = str(caught.value)
    assert message.startswith("SLESS_GATEWAY: ") and said in message and "\n" not in message
    with pytest.raises(StartupError, match=r"^--gateway: "):
        KubeSettings.from_env(BASE_ENV, gateway=value)


def test_serve_refuses_a_bad_gateway_flag_before_it_contacts_anything(tmp_path):
    env = {
        "SLESS_S3_ENDPOINT": "http://127.0.0.1:9",
        "SLESS_S3_BUCKET": "contexts",
        "KUBECONFIG": str(tmp_path / "missing"),
    }
    done = serve_command(
        tmp_path,
        *("--backend", "kubernetes", "--gateway", "edge"),
        *("--repo", "https://git.example.invalid/team/functions.git"),
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "gitops-sless serve: --gateway: 'edge' is not NAMESPACE/NAME "
        "(e.g. envoy-gateway-system/sless)"
    ]


def test_render_shows_the_routes_with_a_gateway_and_refuses_a_bad_one(capsys):
    results = ["--job-result", 'get-time-py={"utc": "now"}', "--job-result", "get-time-js={}"]
    args = ["render", str(ROOT / "sample-repo"), "--gateway", "edge/public", *results]
    assert cli.main(args) == 0
    objects = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]
    routes = _routes(objects)
    assert routes and set(routes) <= {
        o["metadata"]["name"] for o in objects if o["kind"] == "Service"
    }
    assert_valid(routes.values())
    assert cli.main(["render", str(ROOT / "sample-repo"), "--gateway", "Edge/public"]) == 2
    assert "--gateway: 'Edge/public': the namespace 'Edge'" in capsys.readouterr().err


# --- the public URL ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("listener", "address", "url"),
    [
        pytest.param(
            {"protocol": "HTTP", "port": 80}, "203.0.113.9", "http://203.0.113.9", id="ip"
        ),
        pytest.param(
            {"protocol": "HTTP", "port": 8080}, "2001:db8::9", "http://[2001:db8::9]:8080"
        ),
        pytest.param(
            {"protocol": "HTTPS", "port": 443, "hostname": "fn.example.com"},
            "lb-1.elb.example",
            "https://fn.example.com",
            id="listener-hostname",
        ),
        pytest.param(
            {"protocol": "HTTP", "port": 80, "hostname": "*.example.com"},
            "lb-1.elb.example",
            "http://lb-1.elb.example",
            id="wildcard-hostname",
        ),
        pytest.param({"protocol": "HTTP", "port": 80}, None, None, id="no-address-yet"),
    ],
)
def test_the_public_url_is_the_gateways_address(listener, address, url):
    gateway = _gateway_object(listener)
    if address:
        gateway["status"] = {"addresses": [{"type": "IPAddress", "value": address}]}
    assert gateway_url(gateway) == url


def _gateway_object(listener: dict[str, Any] | None = None) -> dict[str, Any]:
    listener = listener or {"protocol": "HTTP", "port": 80}
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": GATEWAY[1], "namespace": GATEWAY[0]},
        "spec": {
            "gatewayClassName": "eg",
            "listeners": [
                {
                    "name": "http",
                    **listener,
                    "allowedRoutes": {
                        "namespaces": {
                            "from": "Selector",
                            "selector": {
                                "matchLabels": {"app.kubernetes.io/managed-by": "gitops-sless"}
                            },
                        }
                    },
                }
            ],
        },
    }


def test_the_readmes_kind_of_gateway_is_valid():
    assert_valid([_gateway_object()])


# --- in the cluster ------------------------------------------------------------------------


def _folder(name: str, timeout: int = 30, http: bool = True) -> dict[str, str]:
    triggers = (
        "      - type: http\n" if http else '      - type: cron\n        schedule: "0 2 * * *"\n'
    )
    manifest_text = (
        f"functions:\n  - name: {name}\n    runtime: python3.11\n    entrypoint: main.handler\n"
        f"    timeoutSec: {timeout}\n    triggers:\n{triggers}"
    )
    return {f"{name}/sless.yaml": manifest_text, f"{name}/main.py": HANDLER}


@pytest.fixture
def cluster(fake_kube: FakeKube) -> KubeClient:
    """The test API server with the Gateway API's kinds, a Gateway and its address."""
    for crd in yaml.safe_load_all(CRDS.read_text(encoding="utf-8")):
        fake_kube.install_crd(crd)
    # every HTTPRoute written is checked against the whole published schema too
    fake_kube.api.admission["HTTPRoute"] = lambda obj: schema_errors([obj])[0]
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    for namespace in (NAMESPACE, GATEWAY[0]):
        client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    client.create(_gateway_object())
    client.apply_status(
        {
            **_gateway_object(),
            "status": {"addresses": [{"type": "IPAddress", "value": "203.0.113.9"}]},
        }
    )
    return client


@pytest.fixture
def harness_for(fake_kube: FakeKube, s3_server: S3Server, tmp_path: Path):
    made: list[Any] = []

    def build(repo: WorkRepo, **changes: Any) -> Any:
        kube_settings = settings(fake_kube.kubeconfig, s3_server.config(), **changes)
        harness = make(repo, tmp_path / f"state-{len(made)}", kube_settings)
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()


def _live_routes(client: KubeClient) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in client.list("HTTPRoute", PROD)}


def test_a_route_is_created_updated_and_pruned_with_its_function(cluster, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("three", {**_folder("alpha"), **_folder("beta"), **_folder("gamma")})
    harness = harness_for(repo, gateway=GATEWAY)
    harness.sync()
    routes = _live_routes(cluster)
    assert set(routes) == {"alpha", "beta", "gamma"}
    assert_valid(routes.values())
    assert routes["alpha"]["spec"]["rules"][0]["timeouts"] == {"request": "30s"}

    before = routes["beta"]["metadata"]["resourceVersion"]
    repo.commit("alpha waits longer", _folder("alpha", timeout=120))
    harness.sync()
    routes = _live_routes(cluster)
    assert routes["alpha"]["spec"]["rules"][0]["timeouts"] == {"request": "120s"}
    assert routes["beta"]["metadata"]["resourceVersion"] == before  # not written again

    repo.commit(
        "beta goes, gamma runs on a schedule only",
        {"beta/sless.yaml": None, "beta/main.py": None, **_folder("gamma", http=False)},
    )
    harness.sync()
    assert set(_live_routes(cluster)) == {"alpha"}
    assert [c["metadata"]["name"] for c in cluster.list("CronJob", PROD)] == ["gamma-cron-0"]


def test_the_test_api_server_refuses_a_route_the_schema_refuses(cluster):
    route = copy.deepcopy(next(iter(_routes(_sample()).values())))
    match = route["spec"]["rules"][0]["matches"][0]
    # header matches are kept as they come by tests/data's CRD: the published schema checks them
    match["headers"] = [{"type": "Fuzzy", "name": "X-Env", "value": "prod"}]
    cluster.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PROD}})
    with pytest.raises(Invalid, match="headers/0/type must be equal to one of the allowed"):
        cluster.apply(route)
    match["headers"][0]["type"] = "Exact"
    assert cluster.apply(route)["metadata"]["name"] == route["metadata"]["name"]


def test_a_pass_with_no_change_writes_no_route(cluster, harness_for, tmp_path, fake_kube):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", _folder("alpha"))
    harness = harness_for(repo, gateway=GATEWAY)
    harness.sync()
    harness.sync()  # the rollout settles, the status is written
    fake_kube.reset_counts()
    harness.sync()
    written = {key: n for key, n in fake_kube.counts()["writes"].items() if n}
    assert not any(kind == "HTTPRoute" for _, kind in written), written


def test_without_a_gateway_no_route_is_made(cluster, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", _folder("alpha"))
    harness = harness_for(repo)
    harness.sync()
    assert [d["metadata"]["name"] for d in cluster.list("Deployment", PROD)] == ["alpha"]
    assert _live_routes(cluster) == {}
    assert harness.function("alpha")["url"].startswith("http://127.0.0.1:8080/fn/prod/alpha/")


def test_the_status_shows_the_url_at_the_gateways_address(cluster, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**_folder("alpha"), **_folder("cron", http=False)})
    harness = harness_for(repo, gateway=GATEWAY)
    harness.sync()
    assert harness.function("alpha")["url"] == "http://203.0.113.9/fn/prod/alpha/"
    assert harness.function("cron")["url"] is None


def test_the_url_follows_an_address_given_later(cluster, harness_for, tmp_path):
    cluster.apply_status({**_gateway_object(), "status": {"addresses": []}})
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", _folder("alpha"))
    harness = harness_for(repo, gateway=GATEWAY)
    harness.backend.gateway_read_sec = 0.0
    harness.sync()
    assert harness.function("alpha")["url"] == "http://127.0.0.1:8080/fn/prod/alpha/"
    address = [{"type": "Hostname", "value": "lb-7.example.net"}]
    cluster.apply_status({**_gateway_object(), "status": {"addresses": address}})
    harness.sync()
    assert harness.function("alpha")["url"] == "http://lb-7.example.net/fn/prod/alpha/"
