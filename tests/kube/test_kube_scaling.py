"""Issue 27 on Kubernetes: autoscaled Deployments, the scale subresource, scale to zero.

An autoscaled function's Deployment is applied without ``spec.replicas``; its
replicas are written through ``deployments/{name}/scale`` by the field
manager ``gitops-sless-autoscaler``, and only when they change. At zero it is
``Idle`` and keeps a route with no upstream, so the proxy holds a call while
``Backend.scale(..., 1)`` starts a replica, and sends it on when the watch
reports the replica ready. Against the test API server (tests/kubeapi).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from gitops_sless.kube import renderer
from gitops_sless.kube.policy import ROUTE_ANNOTATION, RoutePolicy
from gitops_sless.manifests import load as manifest
from gitops_sless.manifests.model import RateLimit, Scale, Warm
from gitops_sless.source.snapshot import DirectorySnapshot

HANDLER = "def handler(event, context):\n    return {'from': %r}\n"


def function_folder(name: str, *extra: str) -> dict[str, str]:
    manifest_text = (
        "functions:\n"
        f"  - name: {name}\n"
        "    runtime: python3.11\n"
        "    entrypoint: main.handler\n"
        "    triggers:\n"
        "      - type: http\n"
    ) + "".join(f"{line}\n" for line in extra)
    return {f"{name}/sless.yaml": manifest_text, f"{name}/main.py": HANDLER % "v1"}


def _objects(root: Path, files: dict[str, str], env: str = "prod") -> dict[str, dict]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    state = manifest.load(DirectorySnapshot(root))
    assert not state.invalid, state.problems
    objects = renderer.render_environment(state, env, builds=False).objects
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


# --- the renderer -------------------------------------------------------------------------------


def test_a_function_without_scale_renders_byte_for_byte_as_before(tmp_path):
    """Upgrading rewrites no Deployment of a fixed count: these digests were taken before
    autoscaling existed (change them only with a deliberate change of the templates)."""
    files = {
        **function_folder("alpha"),
        **function_folder("pair", "    replicas: 2"),
        **function_folder("paused", "    enabled: false"),
    }
    objects = _objects(tmp_path, files)
    kept = [o for o in objects.values() if o["kind"] in ("Deployment", "Service")]
    digest = hashlib.sha256(renderer.dump(kept).encode()).hexdigest()
    assert digest == "3c5be608d784e22d63a43d6ac1e9c17839c9538e89b6fb136ad198d12cc7cf8c"
    assert [objects[f"Deployment/{n}"]["spec"]["replicas"] for n in ("alpha", "pair")] == [1, 2]
    assert all(ROUTE_ANNOTATION not in o["metadata"]["annotations"] for o in kept)


def test_an_autoscaled_deployment_has_no_replicas_and_carries_its_policy(tmp_path):
    files = {
        **function_folder(
            "auto",
            "    scale: {min: 1, max: 4, target: 5, idle: 90s, warm: "
            "[{cron: '0 8 * * 1-5', for: 1h, min: 2}]}",
            "    concurrency: 3",
            "    rateLimit: {rps: 2.5, burst: 5}",
            "    maxBodyBytes: 1000",
        ),
        **function_folder("fixed", "    scale: {min: 2, max: 2}"),
        **function_folder("limited", "    concurrency: 8"),
    }
    objects = _objects(tmp_path, files)
    auto = objects["Deployment/auto"]
    assert "replicas" not in auto["spec"]
    policy = RoutePolicy.decode(auto)
    assert policy == RoutePolicy(
        Scale(1, 4, 5, 90.0, (Warm("0 8 * * 1-5", 3600.0, 2),)),
        3,
        RateLimit(2.5, 5),
        1000,
        "python3.11",
    )
    assert auto["metadata"]["annotations"][renderer.SPEC_HASH] == renderer.spec_hash(auto)
    # min = max is a fixed count: written, as replicas is
    assert objects["Deployment/fixed"]["spec"]["replicas"] == 2
    assert RoutePolicy.decode(objects["Deployment/fixed"]) is None
    # call limits alone: a fixed count, and a route that knows them
    limited = objects["Deployment/limited"]
    assert limited["spec"]["replicas"] == 1
    assert RoutePolicy.decode(limited) == RoutePolicy(None, 8, None, None, "python3.11")


def test_a_preview_scales_to_zero_unless_replicas_are_written(tmp_path):
    files = {**function_folder("alpha"), **function_folder("pair", "    replicas: 2")}
    objects = _objects(tmp_path, files, env="pr-3")
    alpha = objects["Deployment/alpha"]
    assert "replicas" not in alpha["spec"]
    decoded = RoutePolicy.decode(alpha)
    assert decoded is not None and decoded.scale == Scale(0, 1)
    assert objects["Deployment/pair"]["spec"]["replicas"] == 2


def test_a_disabled_autoscaled_function_runs_nothing(tmp_path):
    objects = _objects(tmp_path, function_folder("auto", "    enabled: false", "    scale: {}"))
    assert objects["Deployment/auto"]["spec"]["replicas"] == 0
    assert RoutePolicy.decode(objects["Deployment/auto"]) is None
