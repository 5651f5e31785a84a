"""The status API in process: what each endpoint answers, its refusals, and offline docs."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gitops_sless.manifests import load as manifest
from gitops_sless.plan.backend import deployment_for
from gitops_sless.source.snapshot import DirectorySnapshot
from gitops_sless.state.store import (
    BUILD_PHASES,
    FUNCTION_PHASES,
    JOB_PHASES,
    LOG_TAIL_CHARS,
    Store,
)
from gitops_sless.steps import NoSuchRevision
from gitops_sless.web import models as api_models
from gitops_sless.web.api import create_api
from gitops_sless.web.diffs import DiffRequest

from ..sless_server import ReadAuth

RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
CAMEL = re.compile(r"[a-z][a-zA-Z0-9]*")
DEC_1_2025 = 1764583200.0  # 2025-12-01T10:00:00Z


class RecordingReconciler:
    """Stands in for the reconciler: records sync requests instead of running passes."""

    env = "prod"
    passes = 0

    def __init__(self, finishes: bool = False) -> None:
        self._revisions = RecordingRevisions()
        self.requests: list[str] = []
        self.waits: list[float] = []
        self.finishes = finishes

    def request_sync(self, trigger: str) -> int:
        self.requests.append(trigger)
        return self.passes + 1

    def wait_for_settled(self, after: int, timeout: float) -> bool:
        self.waits.append(timeout)
        return self.finishes

    declared_state: dict[str, Any] = {}  # noqa: RUF012 - what the last pass loaded

    def declared(self) -> dict[str, Any]:
        return self.declared_state

    def exclusively(self, task: Any) -> Any:
        return task()

    def between_passes(self, task: Any) -> Any:
        return task()

    @property
    def revisions(self) -> RecordingRevisions:
        return self._revisions


class RecordingRevisions:
    """Stands in for the reconciler's revisions: records rollbacks and unpins; r1 of fn0 is
    the only revision one can roll back to, and fn0 the only function pinned."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, ...]] = []

    def rollback(self, name: str, to: str | None, by: str) -> None:
        self.asked.append(("rollback", name, str(to), by))
        if name != "fn0" or to not in (None, "r1"):
            raise NoSuchRevision(f"no revision {to} of {name}")

    def unpin(self, name: str, by: str) -> bool:
        self.asked.append(("unpin", name, by))
        return name == "fn0"


class Client:
    """Calls the ASGI app in process, over httpx's ASGI transport.

    With a ``read_token``, reads that carry no Authorization of their own send it.
    """

    def __init__(self, app: Any, read_token: str | None = None) -> None:
        self.app = app
        self.read_token = read_token

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        auth = ReadAuth(self.read_token)

        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://api", auth=auth
            ) as http:
                return await http.request(method, url, **kwargs)

        return asyncio.run(call())

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)


@dataclass
class Api:
    http: Client
    reconciler: RecordingReconciler
    store: Store


def make_api(tmp_path, token="t", secret="s", finishes=False, read_token="r") -> Api:
    """An API with the tokens given; its client reads with the read token ("r")."""
    reconciler = RecordingReconciler(finishes)
    store = Store(tmp_path / "status.db")
    app = create_api(
        reconciler,
        store,
        "main",
        "repo",
        api_token=token,
        webhook_secret=secret,
        read_token=read_token,
    )
    return Api(Client(app, read_token), reconciler, store)


@pytest.fixture
def api(tmp_path) -> Api:
    return make_api(tmp_path)


def finished_sync(store: Store, result: str, revision: str | None, error: str | None = None):
    sync_id = store.begin_sync("prod", "poll")
    store.finish_sync(sync_id, result, revision, error)
    return sync_id


def keys_in(value: Any, path: str = "") -> list[str]:
    """Every object key in a JSON document, except the phase names used as keys of ``phases``."""
    if isinstance(value, list):
        return [key for item in value for key in keys_in(item, path)]
    if not isinstance(value, dict) or path.endswith(".phases"):
        return []
    return [
        found for key, item in value.items() for found in [key, *keys_in(item, f"{path}.{key}")]
    ]


# --- shapes --------------------------------------------------------------------------------


def test_status_tells_the_fetched_revision_from_the_last_good_one(api):
    finished_sync(api.store, "Succeeded", "good111")
    finished_sync(api.store, "Invalid", "bad2222")  # fetched, but one manifest is invalid
    failed = finished_sync(api.store, "Failed", None, "fetch: connection refused")
    api.store.set_function("prod", "a", phase="Ready")
    api.store.set_function("prod", "b", phase="Ready")
    api.store.set_function("prod", "c", phase="Invalid")

    status = api.http.get("/api/v1/status").json()

    assert status["fetchedRevision"] == "bad2222"
    assert status["lastGoodRevision"] == "good111"
    assert status["lastSync"]["id"] == failed
    assert status["lastSync"]["result"] == "Failed"
    assert status["lastSync"]["error"] == "fetch: connection refused"
    assert (status["repository"], status["branch"], status["environment"]) == (
        "repo",
        "main",
        "prod",
    )
    assert (status["functions"], status["phases"]) == (3, {"Ready": 2, "Invalid": 1})


def test_status_before_any_pass_has_no_revisions(api):
    status = api.http.get("/api/v1/status").json()
    assert status["fetchedRevision"] is None
    assert status["lastGoodRevision"] is None
    assert status["lastSync"] is None
    assert (status["functions"], status["phases"]) == (0, {})


def test_repeated_passes_are_one_row_with_a_count_and_last_seen(api):
    single = finished_sync(api.store, "Invalid", "abc")
    api.store.repeat_sync("prod", "poll", DEC_1_2025, "Succeeded", "def", None)
    for _ in range(2):
        api.store.repeat_sync("prod", "poll", DEC_1_2025, "Succeeded", "def", None)

    folded, first = api.http.get("/api/v1/syncs").json()

    assert first["id"] == single
    assert (first["count"], first["lastSeen"]) == (1, None)
    assert folded["started"] == "2025-12-01T10:00:00.000Z"
    assert (folded["count"], folded["result"], folded["revision"]) == (3, "Succeeded", "def")
    assert RFC3339.fullmatch(folded["lastSeen"])
    assert folded["lastSeen"] > folded["started"]


def test_syncs_limit_is_clamped(api):
    for _ in range(3):
        finished_sync(api.store, "Failed", None, "x")
    assert len(api.http.get("/api/v1/syncs", params={"limit": 2}).json()) == 2
    assert len(api.http.get("/api/v1/syncs", params={"limit": -5}).json()) == 1


def test_function_list_names_fields_in_camel_case(api):
    api.store.set_function(
        "prod",
        "greet",
        phase="Ready",
        build_tag="python3.11-abc",
        revision="c0ffee",
        url="http://h/fn/prod/greet/",
        message="serving",
        manifest="functions/greet/sless.yaml",
        spec={"internal": True},
    )
    (fn,) = api.http.get("/api/v1/environments/prod/functions").json()
    updated = fn.pop("updated")
    assert fn == {
        "name": "greet",
        "phase": "Ready",
        "buildTag": "python3.11-abc",
        "revision": "c0ffee",
        "url": "http://h/fn/prod/greet/",
        "message": "serving",
        "manifest": "functions/greet/sless.yaml",
        "restarts": 0,
        "lastExit": None,
        "nextRetry": None,
        "scaling": None,  # not autoscaled
        "servingRevision": None,  # never deployed here
        "pinned": None,
        "openStreams": 0,  # none through the proxy now
        "openSockets": 0,
    }
    assert RFC3339.fullmatch(updated)


def test_restarts_and_last_exit_come_from_the_store(api):
    api.store.set_function("prod", "crashy", phase="Ready", restarts=2, last_exit="exit code 1")
    (fn,) = api.http.get("/api/v1/environments/prod/functions").json()
    assert (fn["restarts"], fn["lastExit"]) == (2, "exit code 1")


def test_a_store_without_restarts_reads_as_none_yet():
    row = {
        "name": "f",
        "phase": "Ready",
        "build_tag": None,
        "revision": None,
        "url": None,
        "message": None,
        "manifest": None,
        "updated": DEC_1_2025,
    }
    fn = api_models.Function.from_row(row).model_dump()
    assert (fn["restarts"], fn["lastExit"]) == (0, None)


def test_function_detail_has_its_build_jobs_and_latest_calls(api):
    api.store.set_function("prod", "greet", phase="Failed", build_tag="py-1", revision="r1")
    api.store.start_build("py-1", "python3.11", "src")
    log = "x" * LOG_TAIL_CHARS + "the end of the log"
    api.store.finish_build("py-1", "Failed", log, "pip install exited 1")
    api.store.set_job_run("prod", "stamp", 2, function="greet", phase="Succeeded", result="{}")
    api.store.set_job_run("prod", "stamp", 1, function="greet", phase="Failed", attempts=3)
    api.store.set_job_run("prod", "other", 1, function="elsewhere", phase="Pending")
    api.store.record_invocations(
        [
            ("prod", "greet", "GET", "/short", 200, 1.2466789012345, DEC_1_2025, "req-1"),
            (
                "prod",
                "greet",
                "POST",
                "/" + "p" * 1000,
                502,
                3.0,
                DEC_1_2025 + 1.5,
                "req-2",
                "ab" * 16,
                812.34,
            ),
        ]
    )

    detail = api.http.get("/api/v1/environments/prod/functions/greet").json()

    assert (detail["name"], detail["phase"], detail["buildTag"]) == ("greet", "Failed", "py-1")
    build = detail["build"]
    assert (build["tag"], build["phase"], build["error"]) == (
        "py-1",
        "Failed",
        "pip install exited 1",
    )
    assert len(build["logTail"]) == LOG_TAIL_CHARS
    assert build["logTail"].endswith("the end of the log")
    assert RFC3339.fullmatch(build["started"]) and RFC3339.fullmatch(build["finished"])
    assert [(j["name"], j["runId"], j["phase"], j["attempts"]) for j in detail["jobs"]] == [
        ("stamp", 2, "Succeeded", 0),
        ("stamp", 1, "Failed", 3),
    ]
    newest, oldest = detail["invocations"]
    assert oldest == {
        "method": "GET",
        "path": "/short",
        "pathTruncated": False,
        "status": 200,
        "durationMs": 1.2,  # one decimal, not the clock's twelve
        "time": "2025-12-01T10:00:00.000Z",
        "requestId": "req-1",
        "traceId": "req-1",  # a trace the proxy started is named by the request id
        "coldStartMs": None,
        "bytes": None,  # not a stream nor a socket
        "chunks": None,
    }
    assert (newest["status"], newest["requestId"], newest["time"]) == (
        502,
        "req-2",
        "2025-12-01T10:00:01.500Z",
    )
    assert (newest["traceId"], newest["coldStartMs"]) == ("ab" * 16, 812.3)
    assert newest["pathTruncated"] is True and len(newest["path"]) == 256


def test_jobs_list_every_run_with_its_run_id(api):
    api.store.set_job_run(
        "prod", "sum", 4, function="summer", phase="Succeeded", result="10", started=DEC_1_2025
    )
    (job,) = api.http.get("/api/v1/environments/prod/jobs").json()
    assert job == {
        "name": "sum",
        "runId": 4,
        "function": "summer",
        "phase": "Succeeded",
        "result": "10",
        "error": None,
        "started": "2025-12-01T10:00:00.000Z",
        "finished": None,
        "attempts": 0,
    }


def test_environments_count_functions_and_show_their_last_sync(api):
    api.store.set_function("prod", "a")
    api.store.set_function("dev", "a")
    api.store.set_function("dev", "b")
    sync_id = finished_sync(api.store, "Succeeded", "abc")
    envs = api.http.get("/api/v1/environments").json()
    assert [(e["name"], e["functions"]) for e in envs] == [("dev", 2), ("prod", 1)]
    assert envs[0]["lastSync"] is None
    assert envs[1]["lastSync"]["id"] == sync_id


def test_no_response_uses_a_store_column_name(api):
    api.store.set_function("prod", "greet", phase="Ready", build_tag="t")
    api.store.start_build("t", "python3.11", "src", folder="functions/greet")
    api.store.set_job_run("prod", "j", 1, function="greet")
    api.store.record_invocations([("prod", "greet", "GET", "/", 200, 1.0, DEC_1_2025, "r")])
    api.store.repeat_sync("prod", "poll", DEC_1_2025, "Succeeded", "abc", None)
    api.store.repeat_sync("prod", "poll", DEC_1_2025, "Succeeded", "abc", None)
    answers = [
        api.http.get(path).json()
        for path in (
            "/api/v1/status",
            "/api/v1/environments",
            "/api/v1/environments/prod/functions",
            "/api/v1/environments/prod/functions/greet",
            "/api/v1/environments/prod/jobs",
            "/api/v1/syncs",
        )
    ]
    answers.append(api.http.post("/api/v1/sync", headers={"Authorization": "Bearer t"}).json())
    keys = {key for answer in answers for key in keys_in(answer)}
    assert {"buildTag", "runId", "requestId", "durationMs", "lastSeen", "logTail"} <= keys
    assert [key for key in keys if not CAMEL.fullmatch(key)] == []


@pytest.mark.parametrize(
    ("epoch", "text"),
    [
        pytest.param(DEC_1_2025 + 0.123, "2025-12-01T10:00:00.123Z", id="milliseconds"),
        pytest.param(DEC_1_2025 - 0.0004, "2025-12-01T10:00:00.000Z", id="rounds-down"),
        pytest.param(DEC_1_2025 + 59.9996, "2025-12-01T10:01:00.000Z", id="rounds-up-a-minute"),
        pytest.param(0, "1970-01-01T00:00:00.000Z", id="epoch"),
        pytest.param(None, None, id="none"),
    ],
)
def test_times_are_rfc3339_utc_with_milliseconds(epoch, text):
    assert api_models.rfc3339(epoch) == text


def test_phases_in_the_schema_are_the_stores():
    def literal(annotation: Any) -> tuple[str, ...]:
        return annotation.__args__

    assert literal(api_models.FunctionPhase) == FUNCTION_PHASES
    assert literal(api_models.JobPhase) == JOB_PHASES
    assert literal(api_models.BuildPhase) == BUILD_PHASES


# --- sync now and refusals --------------------------------------------------------------------


def test_sync_with_the_token_is_accepted_and_waits(tmp_path):
    api = make_api(tmp_path, finishes=True)
    sync_id = finished_sync(api.store, "Succeeded", "abc")
    response = api.http.post(
        "/api/v1/sync", params={"wait": 5}, headers={"Authorization": "Bearer t"}
    )
    assert response.status_code == 202
    body = response.json()
    assert (body["accepted"], body["finished"], body["lastSync"]["id"]) == (True, True, sync_id)
    assert (api.reconciler.requests, api.reconciler.waits) == (["api"], [5])


def test_sync_does_not_wait_longer_than_ten_minutes(api):
    headers = {"Authorization": "Bearer t"}
    body = api.http.post("/api/v1/sync", params={"wait": 86400}, headers=headers).json()
    assert (body["finished"], body["lastSync"]) == (False, None)
    assert api.reconciler.waits == [600]


@pytest.mark.parametrize(
    ("token", "headers", "status", "message"),
    [
        pytest.param("t", {}, 401, "Authorization: Bearer", id="no-header"),
        pytest.param("t", {"Authorization": "Bearer nope"}, 401, "Bearer", id="wrong-token"),
        pytest.param("t", {"Authorization": "Basic dDp0"}, 401, "Bearer", id="not-bearer"),
        pytest.param(None, {"Authorization": "Bearer t"}, 403, "no API token", id="no-token-set"),
    ],
)
def test_sync_refusals(tmp_path, token, headers, status, message):
    api = make_api(tmp_path, token=token, read_token="r" if token else None)
    response = api.http.post("/api/v1/sync", headers=headers)
    assert response.status_code == status
    assert message in response.json()["error"]
    assert api.reconciler.requests == []


@pytest.mark.parametrize(
    ("method", "path", "status", "message"),
    [
        pytest.param(
            "GET",
            "/api/v1/environments/prod/functions/nope",
            404,
            "no function 'nope' in environment 'prod'",
            id="unknown-function",
        ),
        pytest.param(
            "GET",
            "/api/v1/syncs?limit=many",
            422,
            "query parameter 'limit': Input should be a valid integer",
            id="bad-limit",
        ),
        pytest.param(
            "POST",
            "/api/v1/sync?wait=soon",
            422,
            "query parameter 'wait'",
            id="bad-wait",
        ),
        pytest.param("GET", "/api/v2/status", 404, "Not Found", id="unknown-path"),
        pytest.param("GET", "/api/v1/sync", 405, "Method Not Allowed", id="wrong-method"),
    ],
)
def test_errors_are_one_json_shape(api, method, path, status, message):
    response = api.http.request(method, path, headers={"Authorization": "Bearer t"})
    assert response.status_code == status
    assert response.json() == {"error": response.json()["error"]}
    assert message in response.json()["error"]


def test_health_and_metrics(api):
    assert api.http.get("/healthz").json() == {"status": "ok"}
    # ready only once a first pass ran (liveness does not wait for it)
    waiting = api.http.get("/readyz")
    assert waiting.status_code == 503 and waiting.json()["status"] == "not ready"
    api.reconciler.passes = 1
    assert api.http.get("/readyz").json() == {"status": "ready", "reason": "a first pass ran"}
    metrics = api.http.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "sless_syncs_total" in metrics.text


# --- docs ------------------------------------------------------------------------------------


def test_docs_work_offline(api):
    page = api.http.get("/docs")
    assert page.status_code == 200
    links = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", page.text)
    assert links, "the page references no assets"
    assert [link for link in links if re.match(r"(https?:)?//", link)] == []
    assert "cdn." not in page.text and "https://" not in page.text
    for link in links:
        asset = api.http.get(link)
        assert asset.status_code == 200, link
        assert len(asset.content) > 1000, link
    scripts = [api.http.get(link) for link in links if link.endswith(".js")]
    assert any(b"SwaggerUIBundle" in script.content for script in scripts)
    assert api.http.get("/openapi.json").json()["info"]["title"] == "gitops-sless"


# --- diff -----------------------------------------------------------------------------------------

GREET_HANDLER = "def main(event, context):\n    return {}\n"


def _manifest_files(replicas: int = 1, run_id: int = 1, greeting: str = "hi") -> dict[str, str]:
    return {
        "greet/h.py": GREET_HANDLER,
        "greet/sless.yaml": (
            "functions:\n"
            "  - name: greet\n"
            "    runtime: python3.11\n"
            "    entrypoint: h.main\n"
            f"    replicas: {replicas}\n"
            f"    env: {{GREETING: {greeting}, DSN: {{secret: db, key: dsn}}}}\n"
            "    triggers: [{type: http}]\n"
            "    jobs:\n"
            f"      - {{name: stamp, runId: {run_id}}}\n"
            "  - name: shower\n"
            "    runtime: python3.11\n"
            "    entrypoint: h.main\n"
            "    env: {STAMP: {job: stamp}}\n"
        ),
    }


class FixedSource:
    """The mirror of a reconciler: every revision is the one snapshot."""

    def __init__(self, snapshot) -> None:
        self.snapshot_ = snapshot

    def snapshot(self, commit=None):
        return self.snapshot_


def _deployed_api(tmp_path, write_repo) -> tuple[Api, Any]:
    """An API whose store says ``_manifest_files()`` is built, run and deployed."""
    snapshot = DirectorySnapshot(write_repo(_manifest_files(), tmp_path / "deployed"))
    state = manifest.load(snapshot)
    reconciler = RecordingReconciler()
    reconciler.source = FixedSource(snapshot)
    store = Store(tmp_path / "status.db")
    app = create_api(reconciler, store, "main", "repo", api_token="t", webhook_secret="s")
    store.set_job_run("prod", "stamp", 1, function="greet", phase="Succeeded", result='{"n": 1}')
    for fn in state.functions.values():
        store.start_build(fn.build_tag, fn.runtime, fn.source_id)
        store.finish_build(fn.build_tag, "Succeeded", "built")
        spec_hash = deployment_for("prod", fn, {"stamp": '{"n": 1}'}).spec_hash
        store.set_function(
            "prod",
            fn.name,
            phase="Ready",
            build_tag=fn.build_tag,
            revision="r1",
            manifest=fn.manifest,
            spec={"hash": spec_hash, "replicas": fn.replicas, "http": fn.http},
        )
    return Api(Client(app, "t"), reconciler, store), state


def _diff_of(api: Api, tmp_path, write_repo, files: dict[str, str], name: str = "local"):
    state = manifest.load(DirectorySnapshot(write_repo(files, tmp_path / name)))
    body = DiffRequest.from_state(state).model_dump(mode="json")
    response = api.http.post("/api/v1/environments/prod/diff", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_diff_of_what_is_deployed_is_empty(tmp_path, write_repo):
    api, _ = _deployed_api(tmp_path, write_repo)
    answer = _diff_of(api, tmp_path, write_repo, _manifest_files())
    assert answer["hasChanges"] is False
    assert answer["unchanged"] == ["greet", "shower"]
    assert answer["builds"] == answer["added"] == answer["changed"] == answer["jobs"] == []


def test_diff_of_what_the_server_declares_but_cannot_run_yet_is_waiting_not_added(
    tmp_path, write_repo
):
    """A function the server's pass declares and cannot start (its secret is missing) is
    not a change: a sync would do no more for it. The same function changed is."""
    api, state = _deployed_api(tmp_path, write_repo)
    api.store.delete_function("prod", "greet")  # never deployed: it waits for db/dsn
    api.store.set_function(
        "prod", "greet", phase="Pending", manifest="greet/sless.yaml",
        message="secret 'db' key 'dsn': no secrets directory is configured",
    )  # fmt: skip
    api.reconciler.declared_state = state.functions
    answer = _diff_of(api, tmp_path, write_repo, _manifest_files())
    assert answer["hasChanges"] is False
    assert answer["added"] == []
    assert answer["waiting"] == [
        {
            "name": "greet",
            "reason": "not running yet, Pending: secret 'db' key 'dsn': "
            "no secrets directory is configured",
        }
    ]
    changed = _diff_of(api, tmp_path, write_repo, _manifest_files(replicas=3), "changed")
    assert [fn["name"] for fn in changed["added"]] == ["greet"]  # what a sync would start


def test_diff_of_a_manifest_only_change_needs_no_build(tmp_path, write_repo):
    api, _ = _deployed_api(tmp_path, write_repo)
    answer = _diff_of(api, tmp_path, write_repo, _manifest_files(replicas=3))
    assert answer["builds"] == []
    (greet,) = answer["changed"]
    assert [f["field"] for f in greet["fields"]] == ["replicas"]
    assert answer["unchanged"] == ["shower"]


def test_diff_names_changed_fields_never_literal_values(tmp_path, write_repo):
    api, _ = _deployed_api(tmp_path, write_repo)
    files = _manifest_files(replicas=3, greeting="secret-ish-value")
    files["greet/h.py"] = GREET_HANDLER + "# new code: a new build\n"
    answer = _diff_of(api, tmp_path, write_repo, files)
    assert "secret-ish-value" not in json.dumps(answer)
    assert answer["hasChanges"] is True
    (build,) = answer["builds"]
    assert (build["folder"], build["functions"]) == ("greet", ["greet", "shower"])
    greet, shower = answer["changed"]
    fields = {f["field"]: (f["old"], f["new"], f["detail"]) for f in greet["fields"]}
    assert fields["replicas"] == ("1", "3", None)
    assert fields["image"][1] == build["tag"] != fields["image"][0]
    assert fields["env.GREETING"] == (
        "(literal)",
        "(literal)",
        "value changed (literal values are not shown)",
    )
    assert "env.DSN" not in fields  # the same secret reference
    assert [f["field"] for f in shower["fields"]] == ["image"]


def test_diff_runs_a_bumped_job_and_redeploys_what_takes_its_result(tmp_path, write_repo):
    api, _ = _deployed_api(tmp_path, write_repo)
    answer = _diff_of(api, tmp_path, write_repo, _manifest_files(run_id=2))
    assert [(j["name"], j["runId"], j["function"]) for j in answer["jobs"]] == [
        ("stamp", 2, "greet")
    ]
    changed = {fn["name"]: fn["fields"] for fn in answer["changed"]}
    assert changed["shower"][-1] == {
        "field": "env.STAMP",
        "old": "result of job stamp",
        "new": "result of job stamp run 2",
        "detail": "job stamp runs first; redeployed if its result differs",
    }


def test_diff_keeps_what_an_invalid_manifest_declared_and_removes_the_rest(tmp_path, write_repo):
    api, _ = _deployed_api(tmp_path, write_repo)
    api.store.set_function(
        "prod", "old", phase="Ready", manifest="old/sless.yaml", spec={"hash": "x"}
    )
    files = {
        "greet/h.py": GREET_HANDLER,
        "greet/sless.yaml": "functions: [oops\n",  # cannot be read: no names of its own
    }
    answer = _diff_of(api, tmp_path, write_repo, files)
    (invalid,) = answer["invalid"]
    assert invalid["manifest"] == "greet/sless.yaml"
    assert invalid["functions"] == ["greet", "shower"]  # the store knows what it declared
    assert invalid["problems"] == [
        "greet/sless.yaml:1: (file): YAML syntax error: expected ',' or ']', but got '<stream end>'"
        " at the end of the file, in the [ list that starts on this line"
    ]
    assert answer["removed"] == ["old"]
    assert answer["hasChanges"] is True


def test_diff_refuses_bodies_it_cannot_use(api):
    big = api.http.post(
        "/api/v1/environments/prod/diff",
        content=b"{" + b" " * (1 << 20) + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert big.status_code == 413
    assert "larger than 1048576 bytes" in big.json()["error"]
    bad = api.http.post("/api/v1/environments/prod/diff", json={"functions": [{"name": 1}]})
    assert bad.status_code == 422
    assert "body field 'functions.0.name'" in bad.json()["error"]
    spec = {
        "name": "f",
        "folder": "f",
        "manifest": "f/sless.yaml",
        "runtime": "cobol",
        "entrypoint": "h.main",
        "memoryMB": 128,
        "timeoutSec": 30,
        "replicas": 1,
        "enabled": True,
        "http": True,
        "sourceId": "0" * 40,
    }
    unknown = api.http.post("/api/v1/environments/prod/diff", json={"functions": [spec]})
    assert unknown.status_code == 422
    assert "body field 'functions.0.runtime': 'cobol' is not one of" in unknown.json()["error"]
    # the published schema says so: what it allows is what the server takes
    published = api.http.get("/openapi.json").json()
    body = published["paths"]["/api/v1/environments/{env}/diff"]["post"]["requestBody"]
    function = body["content"]["application/json"]["schema"]["properties"]["functions"]["items"]
    assert function["properties"]["runtime"]["enum"] == ["python3.11", "nodejs20"]
    assert function["properties"]["memoryMB"]["minimum"] == 64
    ok = api.http.post("/api/v1/environments/prod/diff", json={"functions": [spec | RUNTIME]})
    assert ok.status_code == 200, ok.text
    # a Python name for a field is not in the schema (additionalProperties: false): refused
    snake = {k: v for k, v in spec.items() if k != "timeoutSec"} | RUNTIME | {"timeout_sec": 30}
    refused = api.http.post("/api/v1/environments/prod/diff", json={"functions": [snake]})
    assert refused.status_code == 422, refused.text
    assert "'timeout_sec' was unexpected" in refused.json()["error"]
    small = api.http.post(
        "/api/v1/environments/prod/diff", json={"functions": [spec | RUNTIME | {"memoryMB": 1}]}
    )
    assert small.status_code == 422 and "1 is less than the minimum of 64" in small.json()["error"]


RUNTIME = {"runtime": "python3.11"}


# --- logs -----------------------------------------------------------------------------------------


def _log(tmp_path, content: bytes, env: str = "prod", name: str = "greet") -> None:
    path = tmp_path / "logs" / env / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


def test_function_logs_are_read_page_by_page_never_inside_a_character(api, tmp_path):
    api.store.set_function("prod", "greet", phase="Ready")
    _log(tmp_path, "ab\né\n".encode())  # é is two bytes: 3 and 4
    headers = {"Authorization": "Bearer t"}
    url = "/api/v1/environments/prod/functions/greet/logs"
    first = api.http.get(url, params={"limit": 4}, headers=headers).json()
    assert first == {
        "text": "ab\n",
        "offset": 0,
        "nextOffset": 3,
        "size": 6,
        "reset": False,
        "finished": False,
    }
    rest = api.http.get(url, params={"offset": 3}, headers=headers).json()
    assert (rest["text"], rest["nextOffset"]) == ("é\n", 6)
    cut = api.http.get(url, params={"offset": 100}, headers=headers).json()
    assert (cut["reset"], cut["offset"], cut["text"]) == (True, 0, "ab\né\n")


def test_function_logs_need_the_token_when_one_is_configured(tmp_path):
    api = make_api(tmp_path)
    api.store.set_function("prod", "greet", phase="Ready")
    _log(tmp_path, b"printed\n")
    url = "/api/v1/environments/prod/functions/greet/logs"
    refused = Client(api.http.app).get(url)  # signed out
    assert refused.status_code == 401
    assert "Authorization: Bearer" in refused.json()["error"]
    assert api.http.get(url, headers={"Authorization": "Bearer t"}).json()["text"] == "printed\n"
    assert api.http.get(url, headers={"Authorization": "Bearer r"}).json()["text"] == "printed\n"

    open_api = make_api(tmp_path / "open", token=None, read_token=None)
    open_api.store.set_function("prod", "greet", phase="Ready")
    _log(tmp_path / "open", b"open\n")
    assert open_api.http.get(url).json()["text"] == "open\n"


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/environments/prod/functions/nope/logs",
        "/api/v1/environments/prod/functions/..%2f..%2fstatus/logs",
        "/api/v1/builds/nope/log",
        "/api/v1/builds/..%2fstatus.db/log",
    ],
)
def test_logs_of_unknown_things_are_404(api, path):
    response = api.http.get(path, headers={"Authorization": "Bearer t"})
    assert response.status_code == 404, response.text


def test_a_build_log_follows_the_file_and_falls_back_to_the_store(api, tmp_path):
    headers = {"Authorization": "Bearer t"}
    api.store.start_build("py-1", "python3.11", "src")
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "py-1.log").write_text("step 1\n")
    running = api.http.get("/api/v1/builds/py-1/log", headers=headers).json()
    assert (running["text"], running["finished"]) == ("step 1\n", False)

    api.store.finish_build("py-1", "Failed", "the whole log kept in the store\n", "exit 1")
    (tmp_path / "artifacts" / "py-1.log").unlink()  # collected
    done = api.http.get("/api/v1/builds/py-1/log", headers=headers).json()
    assert (done["text"], done["finished"]) == ("the whole log kept in the store\n", True)
