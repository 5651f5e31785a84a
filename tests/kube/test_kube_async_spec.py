"""Every replica of the reconciler knows each function's async policy and queue triggers:
the leader writes them into the Function resource, followers read them from there (a
follower declaring none would drop the leader's subscriptions on a shared NATS server)."""

from __future__ import annotations

from gitops_sless.kube.functions import async_policy, function_spec
from gitops_sless.kube.mirror import FunctionMirror
from gitops_sless.manifests.model import DEFAULT_ASYNC, AsyncPolicy
from gitops_sless.state.routes import RouteTable

from ..manifests.test_manifest import load_dir

MANIFEST = """\
functions:
  - name: orders
    runtime: python3.11
    entrypoint: handler.main
    async: {retries: 5, backoff: 2s, maxBackoff: 1m, maxAge: 2h, concurrency: 3}
    triggers: [{type: queue, subject: orders.created}]
"""


def test_a_follower_declares_the_policy_and_subjects_the_leader_wrote(write_repo) -> None:
    root = write_repo({"fn/sless.yaml": MANIFEST, "fn/handler.py": "def main(e):\n    pass\n"})
    fn = load_dir(root).functions["orders"]
    spec = function_spec(fn, "prod")
    assert async_policy(spec) == AsyncPolicy(5, 2.0, 60.0, 7200.0, 3)
    assert spec["subjects"] == ["orders.created"]

    routes = RouteTable()
    mirror = FunctionMirror(None, None, routes, lambda *a: None, lambda: False)  # type: ignore[arg-type]
    resource = {
        "metadata": {"name": "orders", "namespace": "sless-prod"},
        "spec": {**spec, "http": False},
        "status": {"phase": "Ready"},
    }
    mirror._objects = {("prod", "orders"): resource}
    mirror._publish()
    declared = routes.declared("prod", "orders")
    assert declared is not None
    assert declared.async_policy == AsyncPolicy(5, 2.0, 60.0, 7200.0, 3)
    assert declared.subjects == ("orders.created",)


def test_a_resource_written_before_async_existed_has_the_defaults() -> None:
    assert async_policy({"runtime": "python3.11"}) == DEFAULT_ASYNC
