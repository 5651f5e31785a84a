"""A handler's exception never reaches an anonymous caller outside previews (issue 33 item
12): the 500 names the request id, the exception is in the function's log, and
``serve --error-details`` chooses the environments whose callers read it.

From the attacker's side: the caller sends a value the handler puts in its exception
(as ``ValueError(f"bad input: {event}")`` does) and tries to read it, and what the
function knows, back from the answer. It fails by default and works with the protection
off (``--error-details prod``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gitops_sless.errordetail import DEFAULT, ErrorDetails
from gitops_sless.kube.renderer import RenderConfig, render_environment
from gitops_sless.manifests import load as manifest
from gitops_sless.source.snapshot import DirectorySnapshot

from .. import gitserver
from ..gitserver import GitDaemon, WorkRepo, init_bare
from ..sless_server import SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

LEAKY = """\
import os


def main(event, context=None):
    raise ValueError(f"bad input: {event['_query']} with {os.environ['DB_PASSWORD']}")
"""
MANIFEST = """\
functions:
  - name: leaky
    runtime: python3.11
    entrypoint: handler.main
    env:
      DB_PASSWORD: hunter2-db-password
    triggers:
      - type: http
"""
PROBE = "attacker-probe-7731"


@pytest.fixture
def served(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[Callable]:
    init_bare(git_root / "functions.git")
    url = git_daemon.url("functions.git")
    work = WorkRepo(tmp_path / "work")
    work.commit("functions", {"leaky/handler.py": LEAKY, "leaky/sless.yaml": MANIFEST})
    work.push(url)
    servers: list[SlessServer] = []

    def serve(*args: str) -> SlessServer:
        server = SlessServer(url, tmp_path / f"state{len(servers)}", args=list(args))
        servers.append(server)
        server.start()
        server.wait(lambda: (server.function("leaky") or {}).get("phase") == "Ready", "leaky Ready")
        return server

    yield serve
    for server in servers:
        server.stop()


def _attack(server: SlessServer) -> httpx.Response:
    """What an anonymous caller does: no token, its own value in the query."""
    return httpx.get(f"{server.base}/fn/prod/leaky/?q={PROBE}", timeout=30)


def test_by_default_the_caller_reads_the_request_id_and_the_log_has_the_exception(served):
    server = served()
    answer = _attack(server)
    assert answer.status_code == 500
    assert PROBE not in answer.text and "hunter2" not in answer.text
    request_id = answer.headers["x-request-id"]
    assert answer.json() == {
        "error": "the function failed; its log has the details",
        "requestId": request_id,
    }
    # the operator finds the exception by the request id in the function's log
    log = server.wait(
        lambda: (
            text
            if request_id
            in (text := server.client.get("/api/v1/environments/prod/functions/leaky/logs").text)
            else None
        ),
        "the exception in the log",
    )
    assert f"(request {request_id})" in log and PROBE in log and "ValueError: bad input" in log


def test_error_details_for_an_environment_show_its_callers_the_exception(served):
    server = served("--error-details", "prod")
    answer = _attack(server)
    assert answer.status_code == 500
    assert PROBE in answer.json()["error"] and "hunter2-db-password" in answer.json()["error"]


def test_a_bad_error_details_value_is_a_usage_error(tmp_path: Path) -> None:
    serve = [sys.executable, "-m", "gitops_sless", "serve", "--repo", str(tmp_path)]
    done = subprocess.run(
        [*serve, "--state-dir", str(tmp_path / "state"), "--error-details", "prod,Staging!"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    assert "--error-details 'prod,Staging!': 'Staging!' is not an environment name" in done.stderr


# --- the setting itself, and what each backend starts replicas with ----------------


@pytest.mark.parametrize(
    ("text", "prod", "preview", "shown"),
    [
        ("previews", {}, {}, "previews"),
        ("all", {"SLESS_ERROR_DETAIL": "1"}, {}, "all"),
        ("none", {}, {"SLESS_ERROR_DETAIL": "0"}, "none"),
        ("prod", {"SLESS_ERROR_DETAIL": "1"}, {"SLESS_ERROR_DETAIL": "0"}, "prod"),
        ("staging, previews", {}, {}, "staging,previews"),
    ],
)
def test_replicas_are_told_only_where_the_runtime_default_is_not_what_is_asked(
    text: str, prod: dict[str, str], preview: dict[str, str], shown: str
) -> None:
    details = ErrorDetails.parse(text)
    assert details.runtime_env("prod") == prod
    assert details.runtime_env("pr-4") == preview
    assert str(details) == shown


@pytest.mark.parametrize("text", ["", "prod,", "all,prod", "none,previews", "Prod"])
def test_malformed_error_details_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not an environment name"):
        ErrorDetails.parse(text)


def test_kubernetes_deployments_carry_the_setting(write_repo) -> None:
    root = write_repo({"leaky/handler.py": LEAKY, "leaky/sless.yaml": MANIFEST})
    state = manifest.load(DirectorySnapshot(root))

    def env_of(environment: str, details: ErrorDetails) -> dict[str, object]:
        rendered = render_environment(state, environment, RenderConfig(error_details=details))
        deployment = next(o for o in rendered.objects if o["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value") for e in container["env"]}

    assert "SLESS_ERROR_DETAIL" not in env_of("prod", DEFAULT)
    assert env_of("prod", ErrorDetails.parse("prod"))["SLESS_ERROR_DETAIL"] == "1"
    assert env_of("pr-3", ErrorDetails.parse("none"))["SLESS_ERROR_DETAIL"] == "0"
