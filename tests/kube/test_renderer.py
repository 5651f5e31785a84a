"""The renderer: valid Kubernetes objects, deterministic, immune to injection."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gitops_sless.kube import renderer
from gitops_sless.kube.activator import rendered_timeout
from gitops_sless.kube.renderer import (
    ENV_LABEL,
    FUNCTION_LABEL,
    MANAGED_BY,
    SPEC_HASH,
    RenderConfig,
)
from gitops_sless.manifests import load as manifest
from gitops_sless.source.snapshot import DirectorySnapshot

from ..paths import ROOT

SAMPLE = ROOT / "sample-repo"
K8S_VERSION = "1.30.0"
SAMPLE_JOB_RESULTS = {
    "get-time-py": '{"utc": "2026-11-30T00:00:00Z"}',
    "get-time-js": '{"utc": "2026-11-30T00:00:00Z"}',
}


def _render(path: Path, env: str = "prod", **kwargs) -> renderer.Rendered:
    state = manifest.load(DirectorySnapshot(path))
    assert not state.invalid, state.problems
    return renderer.render_environment(state, env, **kwargs)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture(scope="module")
def sample_objects() -> list[dict]:
    rendered = _render(SAMPLE, job_results=SAMPLE_JOB_RESULTS)
    assert rendered.waiting == {}
    return rendered.objects


def _id(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def test_every_sample_object_passes_strict_kubernetes_schema(sample_objects):
    kinds = {obj["kind"] for obj in sample_objects}
    assert kinds == {"Namespace", "NetworkPolicy", "Deployment", "Service", "CronJob", "Job"}
    for obj in sample_objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_strict_validation_would_catch_a_bad_object(sample_objects):
    # guards the test above: the validator really rejects unknown fields
    deployment = next(o for o in sample_objects if o["kind"] == "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["memoryMB"] = 128
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_objects_carry_labels_and_a_matching_spec_hash(sample_objects):
    for obj in sample_objects:
        labels = obj["metadata"]["labels"]
        assert labels[MANAGED_BY] == "gitops-sless", _id(obj)
        annotation = obj["metadata"]["annotations"][SPEC_HASH]
        assert annotation == renderer.spec_hash(obj), _id(obj)
        if obj["kind"] in ("Deployment", "Service", "CronJob") or "job" in str(labels):
            assert labels[ENV_LABEL] == "prod"
            assert labels[FUNCTION_LABEL]


def test_images_are_content_tagged_never_latest(sample_objects):
    images = [
        c["image"]
        for o in sample_objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    ]
    assert images
    for image in images:
        name, tag = image.rsplit(":", 1)
        assert name == "localhost:5000/sless/functions"
        assert tag != "latest" and len(tag) > 20


def _pod_specs(objects: list[dict]) -> list[dict]:
    """Pod specs of every function workload (build jobs live elsewhere and run kaniko)."""
    pods = []
    for obj in objects:
        if obj["metadata"].get("namespace") != "sless-prod":
            continue
        spec = obj.get("spec", {})
        template = spec.get("jobTemplate", {}).get("spec", spec).get("template")
        if template:
            pods.append(template["spec"])
    return pods


def test_containers_are_locked_down(sample_objects):
    pods = _pod_specs(sample_objects)
    assert len(pods) > 10
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc["allowPrivilegeEscalation"] is False
            assert container["resources"]["limits"]["memory"].endswith("Mi")


def test_http_function_gets_health_probe_and_runner_gets_event(sample_objects):
    by_id = {_id(o): o for o in sample_objects}
    server = by_id["Deployment/greeting-py"]["spec"]["template"]["spec"]["containers"][0]
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    assert server["command"] == ["python3", "/opt/sless/server.py"]
    job = by_id["Job/sum-numbers-py-run-1"]["spec"]["template"]["spec"]["containers"][0]
    assert job["command"] == ["python3", "/opt/sless/runner.py"]
    env = {e["name"]: e.get("value") for e in job["env"]}
    assert json.loads(env["SLESS_EVENT"]) == {"numbers": [1, 2, 3.5, 4]}
    assert "readinessProbe" not in job


def test_env_is_sorted_and_secrets_are_references(sample_objects):
    by_id = {_id(o): o for o in sample_objects}
    env = by_id["Deployment/notes-py"]["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert names == sorted(names)
    pg = next(e for e in env if e["name"] == "PG_DSN")
    assert pg == {
        "name": "PG_DSN",
        "valueFrom": {"secretKeyRef": {"name": "notes-db", "key": "dsn"}},
    }


def test_with_an_otlp_endpoint_every_runtime_sends_its_spans_there(sample_objects):
    def otlp(objects: list[dict], name: str) -> dict[str, str]:
        deployment = next(o for o in objects if _id(o) == f"Deployment/{name}")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        return {e["name"]: e["value"] for e in env if e["name"].startswith("SLESS_OTLP")}

    assert otlp(sample_objects, "notes-py") == {}  # not exported: nothing set
    config = RenderConfig(otlp_endpoint="http://collector.tracing:4318")
    traced = _render(SAMPLE, config=config, job_results=SAMPLE_JOB_RESULTS).objects
    assert otlp(traced, "notes-py") == {
        "SLESS_OTLP_ENDPOINT": "http://collector.tracing:4318",
        "SLESS_OTLP_SERVICE": "prod/notes-py",
    }


def test_preview_environment_uses_overrides_and_own_namespace():
    objects = _render(SAMPLE, env="pr-7", job_results=SAMPLE_JOB_RESULTS).objects
    by_id = {_id(o): o for o in objects}
    assert all(o["metadata"]["namespace"] in ("sless-pr-7", "gitops-sless") for o in objects[1:])
    env = by_id["Deployment/notes-py"]["spec"]["template"]["spec"]["containers"][0]["env"]
    pg = next(e for e in env if e["name"] == "PG_DSN")
    assert pg["valueFrom"]["secretKeyRef"]["name"] == "notes-db-preview"


def test_job_result_reaches_dependent_function_or_it_waits():
    waiting = _render(SAMPLE)
    assert waiting.waiting == {
        "time-display-js": ["get-time-js"],
        "time-display-py": ["get-time-py"],
    }
    assert "Deployment/time-display-py" not in {_id(o) for o in waiting.objects}
    ready = _render(SAMPLE, job_results=SAMPLE_JOB_RESULTS)
    deployment = {_id(o): o for o in ready.objects}["Deployment/time-display-py"]
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["JOB_TIME"] == SAMPLE_JOB_RESULTS["get-time-py"]


def test_rendering_twice_is_byte_identical():
    first = renderer.dump(_render(SAMPLE, job_results=SAMPLE_JOB_RESULTS).objects)
    second = renderer.dump(_render(SAMPLE, job_results=SAMPLE_JOB_RESULTS).objects)
    assert first == second
    assert first.count("\n---\n") + 1 == first.count("apiVersion:")


HOSTILE = {
    "NEWLINE": "a\nb: c",
    "MUSTACHE": "{{ .Values.secret }}",
    "DOLLAR": "${image}",
    "DOLLAR_NAME": "${name}-x",
    "ANCHOR": "&anchor [1, 2]",
    "ALIAS": "*anchor",
    "DOC": "---\nkind: Secret",
    "FLOW": "{a: 1}",
}


def _hostile_repo(tmp_path: Path) -> Path:
    env = "\n".join(f"      {k}: {json.dumps(v)}" for k, v in HOSTILE.items())
    return _write(
        tmp_path,
        {
            "fn/handler.py": "def main(event):\n    return event\n",
            "fn/sless.yaml": (
                "functions:\n"
                "  - name: hostile\n"
                "    runtime: python3.11\n"
                "    entrypoint: handler.main\n"
                "    env:\n"
                f"{env}\n"
                "    triggers:\n"
                "      - type: http\n"
                "      - type: cron\n"
                "        schedule: '0 1 * * *'\n"
                "        event: {payload: '${image}', nested: {x: '{{ y }}'}}\n"
            ),
        },
    )


def test_injection_attempts_come_out_as_literal_strings(tmp_path):
    objects = _render(_hostile_repo(tmp_path)).objects
    text = renderer.dump(objects)
    reparsed = list(yaml.safe_load_all(text))
    assert reparsed == objects  # nothing added, nothing merged: one document per object
    deployment = next(o for o in reparsed if o["kind"] == "Deployment")
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    for name, value in HOSTILE.items():
        assert env[name] == value
    assert [o["kind"] for o in reparsed].count("Secret") == 0
    cron = next(o for o in reparsed if o["kind"] == "CronJob")
    cron_env = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["env"]
    event = json.loads(next(e["value"] for e in cron_env if e["name"] == "SLESS_EVENT"))
    assert event == {"nested": {"x": "{{ y }}"}, "payload": "${image}"}
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_disabled_function_scales_to_zero_and_suspends_cron(tmp_path):
    repo = _write(
        tmp_path,
        {
            "fn/handler.py": "def main(event):\n    return 1\n",
            "fn/sless.yaml": (
                "functions:\n"
                "  - name: sleepy\n"
                "    runtime: python3.11\n"
                "    entrypoint: handler.main\n"
                "    replicas: 3\n"
                "    enabled: false\n"
                "    memoryMB: 256\n"
                "    triggers: [{type: http}, {type: cron, schedule: '*/5 * * * *'}]\n"
            ),
        },
    )
    by_id = {_id(o): o for o in _render(repo).objects}
    assert by_id["Deployment/sleepy"]["spec"]["replicas"] == 0
    assert by_id["CronJob/sleepy-cron-0"]["spec"]["suspend"] is True
    limits = by_id["Deployment/sleepy"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert limits["limits"]["memory"] == "256Mi"


def test_job_with_run_id_zero_is_defined_but_not_rendered(tmp_path):
    repo = _write(
        tmp_path,
        {
            "fn/handler.py": "def main(event):\n    return 1\n",
            "fn/sless.yaml": (
                "functions:\n"
                "  - name: worker\n"
                "    runtime: python3.11\n"
                "    entrypoint: handler.main\n"
                "    jobs:\n"
                "      - {name: never, runId: 0}\n"
                "      - {name: twice, runId: 2}\n"
            ),
        },
    )
    names = {_id(o) for o in _render(repo).objects}
    assert "Job/twice-run-2" in names
    assert not any("never" in n for n in names)
    assert not any(n.startswith("Deployment/") for n in names)  # no http trigger, no server


def test_build_jobs_are_one_per_tag_and_deterministically_named(sample_objects):
    builds = [o for o in sample_objects if o["metadata"]["name"].startswith("build-")]
    state = manifest.load(DirectorySnapshot(SAMPLE))
    tags = {fn.build_tag for fn in state.functions.values()}
    assert len(builds) == len(tags)
    for build in builds:
        kubernetes_validate.validate(build, K8S_VERSION, strict=True)
        args = build["spec"]["template"]["spec"]["containers"][0]["args"]
        tag = build["metadata"]["labels"]["gitops-sless.dev/build-tag"]
        assert f"--destination=localhost:5000/sless/functions:{tag}" in args
        assert build["metadata"]["name"] == renderer.build_job_name(tag)


def test_registry_is_configurable(tmp_path):
    config = RenderConfig(registry="registry.example.com:5000/team")
    objects = _render(SAMPLE, config=config, job_results=SAMPLE_JOB_RESULTS).objects
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("registry.example.com:5000/team/functions:")


def test_a_stream_block_tells_the_runtime_its_limits(tmp_path, sample_objects):
    repo = _write(
        tmp_path,
        {
            "fn/handler.py": "def main(event):\n    yield 'x'\n",
            "fn/sless.yaml": (
                "functions:\n"
                "  - name: feed\n"
                "    runtime: python3.11\n"
                "    entrypoint: handler.main\n"
                "    stream: {idleSec: 5, maxSec: 120}\n"
                "    triggers: [{type: http}]\n"
            ),
        },
    )

    def limits(objects: list[dict], name: str) -> dict[str, str]:
        deployment = next(o for o in objects if _id(o) == f"Deployment/{name}")
        env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        return {e["name"]: e["value"] for e in env if e["name"].startswith("SLESS_STREAM")}

    assert limits(_render(repo).objects, "feed") == {
        "SLESS_STREAM_IDLE_SEC": "5",
        "SLESS_STREAM_MAX_SEC": "120",
    }
    assert limits(sample_objects, "notes-py") == {}  # not named: the runtime's defaults

    # a Gateway's request timeout bounds the whole exchange: the route's covers the stream
    routed = _render(repo, config=RenderConfig(gateway=("gateways", "public"))).objects
    route = next(o for o in routed if o["kind"] == "HTTPRoute")
    assert route["spec"]["rules"][0]["timeouts"]["request"] == "150s"  # 30 + 120
    deployment = next(o for o in routed if o["kind"] == "Deployment")
    assert rendered_timeout(deployment) == "150"  # as the route is rendered again from it
