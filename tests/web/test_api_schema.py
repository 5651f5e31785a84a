"""Generated requests against every API operation: no 5xx, every answer the declared one,
and the published schema the one enforced (tests/web/test_api_schema_live.py: a live server).

schemathesis reads the app's own /openapi.json and calls the ASGI app in
process; the store behind it holds functions in every phase, builds, jobs,
invocations and syncs, so the answers carry real data, not empty lists.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import schemathesis
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS as ALL_CHECKS

from gitops_sless.plan.backend import deployment_for
from gitops_sless.state import serving
from gitops_sless.state.store import FUNCTION_PHASES, Store
from gitops_sless.web.api import create_api

from ..state.test_serving import EVERYTHING as FUNCTION
from .test_api import RecordingReconciler

TOKEN = "schema-token"
SECRET = "schema-secret"
# every check, positive_data_acceptance and negative_data_rejection among them: a body
# the published schema allows is taken, one it forbids is refused
CHECKS = ALL_CHECKS.get_all()
EXAMPLES = settings(max_examples=30, deadline=None, database=None)


def fill(store: Store) -> None:
    for i, phase in enumerate(FUNCTION_PHASES):
        name = f"fn{i}"
        store.set_function(
            "prod", name, phase=phase, build_tag=f"python3.11-{i}", revision="abc", url="http://h/"
        )
        store.start_build(f"python3.11-{i}", "python3.11", "src", folder=f"functions/{name}")
        store.set_job_run("prod", f"job{i}", 1, function=name, phase="Succeeded", result="{}")
        store.record_invocations(
            [("prod", name, "GET", "/" + "p" * 300, 200, 1.5, 1764583200.0, f"req-{i}")]
        )
    store.finish_build("python3.11-0", "Failed", "log\n" * 2000, "pip install exited 1")
    store.set_function("dev", "other", phase="Pending")
    sync_id = store.begin_sync("prod", "startup")
    store.finish_sync(sync_id, "Invalid", "abc", None)
    for _ in range(3):
        store.repeat_sync("prod", "poll", 1764583200.0, "Succeeded", "def", None)
    store.begin_sync("prod", "api")  # still running
    for version in ("1", "2"):
        function = replace(FUNCTION, build_tag=f"tag-{version}")
        deployment = deployment_for("prod", function, {"seed": "{}"})
        record = serving.to_record(deployment)
        store.add_revision("prod", "fn0", deployment.spec_hash, record, "abc" + version)
        store.set_serving("prod", "fn0", record, "abc" + version)
    store.pin("prod", "fn0", 2, None, "api")


OPERATIONS = [
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/api/v1/status"),
    ("GET", "/api/v1/environments"),
    ("DELETE", "/api/v1/environments/{env}"),
    ("GET", "/api/v1/environments/{env}/functions"),
    ("GET", "/api/v1/environments/{env}/functions/{name}"),
    ("GET", "/api/v1/environments/{env}/jobs"),
    ("GET", "/api/v1/syncs"),
    ("POST", "/api/v1/sync"),
    ("POST", "/api/v1/webhooks/{forge}"),
    ("POST", "/api/v1/environments/{env}/diff"),
    ("GET", "/api/v1/environments/{env}/functions/{name}/logs"),
    ("GET", "/api/v1/builds/{tag}/log"),
    ("GET", "/api/v1/environments/{env}/functions/{name}/revisions"),
    ("POST", "/api/v1/environments/{env}/functions/{name}/rollback"),
    ("POST", "/api/v1/environments/{env}/functions/{name}/unpin"),
    ("GET", "/api/v1/notifications"),
]
# path parameters that name what the store holds, so answers are not all empty or 404
KNOWN = {"env": "prod", "name": "fn0", "forge": "github", "tag": "python3.11-0"}


@pytest.fixture
def api_schema(tmp_path):
    store = Store(tmp_path / "status.db")
    fill(store)
    reconciler = RecordingReconciler()
    reconciler.passes = 1  # ready: /readyz's 503 is a declared answer, but flagged as a 5xx
    app = create_api(reconciler, store, "main", "repo", api_token=TOKEN, webhook_secret=SECRET)
    # /openapi.json is a read like any other: it needs the token
    token = {"Authorization": f"Bearer {TOKEN}"}
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=token)


def cases(schema, method: str, path: str) -> st.SearchStrategy:
    """Generated requests, valid and not, some naming real things, some with the token."""
    operation = schema[path][method]
    known = {key: value for key, value in KNOWN.items() if "{" + key + "}" in path}
    strategies = [operation.as_strategy(mode) for mode in GenerationMode]
    if known:
        strategies.append(operation.as_strategy(path_parameters=known))
    if path not in ("/healthz", "/readyz"):  # every other call needs a token: send it too
        token = {"Authorization": f"Bearer {TOKEN}"}
        strategies.append(operation.as_strategy(headers=token, path_parameters=known or None))
    return st.one_of(strategies)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_answer_is_declared(api_schema, method, path):
    @given(case=cases(api_schema, method, path))
    @EXAMPLES
    def call(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=CHECKS)  # raises on a 5xx or an undeclared answer

    call()


def test_the_schema_declares_every_operation(api_schema):
    operations = (result.ok() for result in api_schema.get_all_operations())
    declared = {(op.method.upper(), op.path) for op in operations}
    assert declared == set(OPERATIONS)
