"""Whose pull requests a preview runs, what secrets it gets, and what the forge hears.

Written from the attacker's side: a pull request from a fork names production's
secret in its manifest (``env`` and ``preview.env``), has a function that prints
its whole environment and a job that fails with the secret in its error, and one
more job that fails with a secret-looking string. End to end against a real
``serve --previews``, a git daemon, the forge imitation (GitHub's API) and
signed webhooks built from the fixtures; then :class:`Previews` in process with
doubles, for every rule of ``--preview-trust`` and the filter, and the pure
rules of :mod:`gitops_sless.previews.trust`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gitops_sless import cli
from gitops_sless.previews.environments import PinnedSource, PreviewConfig, Previews
from gitops_sless.previews.pulls import PullRequest
from gitops_sless.previews.reporter import PreviewReport
from gitops_sless.previews.trust import ORIGIN_UNKNOWN, TRUST_LEVELS, Gate, decide, label_commit
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store

from .. import gitserver
from ..gitserver import GitDaemon
from ..sless_server import SlessServer
from ..test_serve_start import assert_refused
from ..test_serve_start import serve as serve_command
from .test_forge import FakeForge
from .test_forge import serve as serve_forge
from .test_previews import (
    CHANGED,
    NEW,
    OLD,
    PAYLOADS,
    BackendDouble,
    ForgeDouble,
    MirrorDouble,
    ReconcilerDouble,
    ReporterDouble,
    Setup,
    alive,
    answer,
    builds,
    comments,
    function,
    github_pull,
    in_state,
    listing,
    preview,
    processes,
    send,
    statuses,
    until,
)

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

APPROVE = "preview"
LOOKS_SECRET = "ghp_" + "Zx9q" * 9  # what a token looks like: no forge report may carry it
NOT_AVAILABLE = 'secret "payments" is not available to previews'


# --- the repository and the attack -------------------------------------------------------

LEAK = """
import json, os

def main(event, context):
    if event.get("fail"):
        raise RuntimeError("X=" + os.environ.get("X", "<unset>"))
    return {"env": dict(os.environ)}
"""

ENVDUMP = """
import json, os

def main(event, context):
    if event.get("fail"):
        raise RuntimeError("token %s env %s" % ({token!r}, json.dumps(dict(os.environ))))
    return {{"env": dict(os.environ)}}
"""


def attack(text: str) -> dict[str, str]:
    """What the PR changes: greet answers ``text``; ``leak`` names production's secret
    (in env and preview.env), prints its environment, and has a job that fails with the
    secret in its error; ``envdump`` prints its environment and has a job that fails with a
    token-looking string. ``text`` also makes the trees (and so the builds) of each PR its
    own."""
    mark = f"# {text}\n"
    return {
        f"{CHANGED}/handler.py": (
            "def main(event, context):\n"
            f"    return {{'text': {text!r}, 'env': context.environment}}\n"
        ),
        "leak/handler.py": mark + LEAK,
        "leak/sless.yaml": (
            "functions:\n"
            "  - name: leak\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    triggers: [{type: http}]\n"
            "    env: {X: {secret: payments, key: api-key}}\n"
            "    preview: {env: {X: {secret: payments, key: api-key}}}\n"
            "    jobs: [{name: leak-job, runId: 1, event: {fail: true}}]\n"
        ),
        "envdump/handler.py": mark + ENVDUMP.format(token=LOOKS_SECRET),
        "envdump/sless.yaml": (
            "functions:\n"
            "  - name: envdump\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    triggers: [{type: http}]\n"
            "    jobs: [{name: boom, runId: 1, event: {fail: true}}]\n"
        ),
    }


def write_secret(root: Path, value: str) -> Path:
    (root / "payments").mkdir(parents=True)
    (root / "payments" / "api-key").write_text(value + "\n")
    return root


class Trust:
    """One test's repository, forge imitation, secrets and server."""

    def __init__(self, setup: Setup, fake: FakeForge) -> None:
        self.setup, self.fake = setup, fake
        self.prod_secret = "sk_live_" + secrets.token_hex(16)
        self.prod_secrets = write_secret(setup.tmp_path / "prod-secrets", self.prod_secret)
        setup.push_main(function(CHANGED, "main"))

    def serve(self, trust: str, preview_secrets: Path | None = None) -> SlessServer:
        args = ["--forge", "github", "--forge-api", self.fake.url]
        if preview_secrets is not None:
            args += ["--preview-secrets-dir", str(preview_secrets)]
        return self.setup.serve(
            args=args,
            env={"SLESS_FORGE_TOKEN": self.fake.token},
            poll_interval=1,  # the forge's list is read every 15 s
            trust=trust,
            secrets_dir=self.prod_secrets,
        )

    def list(self, number: int, head: str, origin: str, labels: tuple[str, ...] = ()) -> None:
        """The PR as GitHub's API lists it from now on."""
        with self.fake.lock:
            self.fake.pulls = [p for p in self.fake.pulls if p["number"] != number]
            self.fake.add_pull(number, labels=labels, origin=origin)
            self.fake.pulls[-1]["head"]["sha"] = head
            self.fake.pulls[-1]["head"]["ref"] = f"change-{number}"

    def open_fork(self, server: SlessServer, number: int, text: str) -> str:
        head = self.setup.push_pull(number, attack(text))
        self.list(number, head, "fork")
        event = fork_event("opened", number, head)
        assert send(server, "github", event, "pull_request").status_code == 202
        server.sync()  # fetches the ref
        return head

    def push_fork(self, server: SlessServer, number: int, text: str) -> str:
        head = self.setup.push_pull(number, attack(text))
        self.list(number, head, "fork", labels=(APPROVE,))
        event = fork_event("synchronize", number, head, labels=(APPROVE,))
        assert send(server, "github", event, "pull_request").status_code == 202
        server.sync()
        return head

    def label(self, server: SlessServer, number: int, head: str, by: str) -> None:
        """``by`` adds the approval label at ``head`` (GitHub's ``labeled`` event)."""
        self.list(number, head, "fork", labels=(APPROVE,))
        event = fork_event("labeled", number, head, sender=by, labels=(APPROVE,))
        assert send(server, "github", event, "pull_request").status_code == 202


def fork_event(
    action: str, number: int, sha: str, sender: str = "mallory", labels: tuple[str, ...] = ()
) -> bytes:
    """A pull_request event of a PR from mallory's fork (the labeled fixture, reshaped)."""
    data = json.loads((PAYLOADS / "github-pull-request-labeled-fork.json").read_text())
    data["action"] = action
    if action != "labeled":
        del data["label"]
    pr = data["pull_request"]
    data["number"] = pr["number"] = number
    pr["head"]["sha"] = sha
    pr["head"]["ref"] = f"change-{number}"
    pr["labels"] = [{"id": 1, "name": name} for name in labels]
    data["sender"] = {"login": sender, "id": 5550001 if sender == "mallory" else 6660002}
    return json.dumps(data).encode()


@pytest.fixture
def fake_github() -> Iterator[FakeForge]:
    fake, http = serve_forge("github")
    yield fake
    http.shutdown()
    http.server_close()


@pytest.fixture
def trust(setup: Setup, fake_github: FakeForge) -> Trust:
    return Trust(setup, fake_github)


@pytest.fixture
def setup(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[Setup]:
    s = Setup(tmp_path, git_daemon, git_root)
    yield s
    for server in s.servers:
        server.stop()


# --- what the server shows ------------------------------------------------------------------


def waiting_because(server: SlessServer, number: int, words: str):
    """A check: the preview's row once it is Waiting with ``words`` in its reason."""

    def check() -> dict[str, Any] | None:
        row = preview(server, number)
        ok = row and row["state"] == "Waiting" and words in (row["reason"] or "")
        return row if ok else None

    return check


def ok(response: httpx.Response) -> httpx.Response | None:
    return response if response.status_code == 200 else None


def fn_status(server: SlessServer, env: str, name: str) -> dict[str, Any]:
    found = server.function(name, env)
    assert found is not None, f"{name} not in {env}"
    return found


def job(server: SlessServer, env: str, name: str) -> dict[str, Any] | None:
    return next((j for j in server.jobs(env) if j["name"] == name), None)


def everything_said(server: SlessServer, fake: FakeForge, env: str) -> dict[str, str]:
    """Every text a reader, the PR's author or a forge visitor could see: responses of
    /fn/, the API and the dashboard, statuses, comments, and the server's log."""
    get = server.client.get
    said = {"log": server.output()}
    names = [f["name"] for f in get(f"/api/v1/environments/{env}/functions").json()]
    paths = [
        "/",
        "/api/v1/status",
        "/api/v1/environments",
        "/api/v1/syncs",
        f"/api/v1/environments/{env}/functions",
        f"/api/v1/environments/{env}/jobs",
        "/metrics",
    ]
    for name in names:
        paths += [
            f"/fn/{env}/{name}/",
            f"/api/v1/environments/{env}/functions/{name}",
            f"/api/v1/environments/{env}/functions/{name}/logs",
            f"/functions/{env}/{name}",
        ]
    for path in paths:
        response = get(path)
        said[path] = f"{response.status_code} {response.text}"
    for build in {f.get("buildTag") for f in get(f"/api/v1/environments/{env}/functions").json()}:
        if build:
            said[f"build {build}"] = get(f"/api/v1/builds/{build}/log").text
    with fake.lock:
        said["statuses"] = json.dumps(fake.statuses)
        said["comments"] = json.dumps(fake.comments)
    return said


def nowhere(value: str, said: dict[str, str]) -> None:
    leaked = [where for where, text in said.items() if value in text]
    assert not leaked, f"{value[:12]}… shown in {leaked}"


# --- end to end -----------------------------------------------------------------------------


def test_same_repo_never_builds_a_fork_and_a_same_repo_pr_gets_the_preview_secret(trust, setup):
    preview_value = "preview-only-" + secrets.token_hex(8)
    preview_secrets = write_secret(setup.tmp_path / "preview-secrets", preview_value)
    server = trust.serve("same-repo", preview_secrets)
    before = builds(server)

    fork = trust.open_fork(server, 7, "fork v1")
    row = until(waiting_because(server, 7, "from a fork"), "pr-7 Waiting: a fork", server)
    assert "--preview-trust approved" in row["reason"]
    assert row["head"] == fork

    # a PR from the repository itself: built, and its preview-scope secret resolved
    same = setup.push_pull(8, attack("same v1"))
    trust.list(8, same, "same")
    assert send(server, "github", github_pull("opened", 8, same), "pull_request").status_code == 202
    server.sync()
    until(lambda: answer(server, "pr-8") == "same v1", "pr-8 serving", server)
    leak = until(lambda: ok(server.client.get("/fn/pr-8/leak/")), "pr-8's leak serving", server)
    assert leak.json()["env"]["X"] == preview_value  # the preview's, never production's
    until(in_state(server, 8, "Failed", same), "pr-8 Failed: its jobs fail", server)
    until(lambda: job(server, "pr-8", "leak-job")["phase"] == "Failed", "leak-job failed", server)

    # the fork was never built: only pr-8's three folders were (greet, leak, envdump)
    assert builds(server) - before == 3
    assert listing(server)["pr-7"]["functions"] == 0
    assert preview(server, 7)["state"] == "Waiting"
    assert processes(setup.state, "pr-7") == {}
    assert server.client.get("/fn/pr-7/leak/").status_code == 404
    assert statuses(trust.fake, fork) == []  # nothing to say on a fork it will never run

    # the forge hears names and states, never what a function printed
    def final_status() -> dict[str, Any] | None:
        last = statuses(trust.fake, same)[-1:]
        return last[0] if last and "job leak-job failed" in last[0]["description"] else None

    status = until(final_status, "pr-8's failure status naming both jobs", server)
    assert status["state"] == "failure"
    failed = re.findall(r"job [a-z-]+ failed", status["description"])
    assert sorted(failed) == ["job boom failed", "job leak-job failed"], status
    assert status["target_url"] == f"{server.base}/fn/pr-8/"
    until(lambda: "job leak-job failed" in str(comments(trust.fake, 8)), "the comment", server)
    [comment] = comments(trust.fake, 8)
    assert (
        "job boom failed" in comment["body"] and f"{server.base}/fn/pr-8/leak/" in comment["body"]
    )
    said = json.dumps([statuses(trust.fake, same), comments(trust.fake, 8)])
    for printed in (LOOKS_SECRET, preview_value, "X=", "RuntimeError", "Traceback"):
        assert printed not in said, printed
    # the API does keep the job's error, for those who may read it
    assert LOOKS_SECRET in job(server, "pr-8", "boom")["error"]
    nowhere(trust.prod_secret, everything_said(server, trust.fake, "pr-8"))


def test_approved_runs_a_fork_once_a_writer_labels_it_and_never_with_production_secrets(
    trust, setup
):
    trust.fake.roles.update(carol="write")
    server = trust.serve("approved")  # no --preview-secrets-dir: previews get no secret
    before = builds(server)
    head = trust.open_fork(server, 7, "fork v1")
    waits = f'waits for a user with write access to add the label "{APPROVE}" at commit {head[:12]}'
    until(waiting_because(server, 7, waits), "pr-7 waiting for approval", server)
    until(
        lambda: {s["state"] for s in statuses(trust.fake, head)} == {"pending"},
        "a pending status: waiting for approval",
        server,
    )
    assert statuses(trust.fake, head)[0]["description"].startswith("preview waiting: from a fork")

    # the PR's author adds the label: the forge says mallory may only read
    trust.label(server, 7, head, by="mallory")
    server.sync()
    until(waiting_because(server, 7, "mallory has no write access"), "mallory refused", server)
    assert builds(server) == before
    assert listing(server)["pr-7"]["functions"] == 0

    # a writer approves the head: it runs, without the secret it names
    trust.label(server, 7, head, by="carol")
    server.sync()
    until(lambda: answer(server, "pr-7") == "fork v1", "pr-7 serving once approved", server)
    until(lambda: fn_status(server, "pr-7", "leak")["phase"] == "Pending", "leak Pending", server)
    assert fn_status(server, "pr-7", "leak")["message"].startswith(NOT_AVAILABLE)
    until(lambda: (job(server, "pr-7", "leak-job") or {}).get("phase") == "Pending", "job", server)
    assert job(server, "pr-7", "leak-job")["error"].startswith(NOT_AVAILABLE)
    refused = server.client.get("/fn/pr-7/leak/")
    assert refused.status_code == 503
    assert (refused.json()["phase"], refused.json()["message"][: len(NOT_AVAILABLE)]) == (
        "Pending",
        NOT_AVAILABLE,
    )
    env = server.client.get("/fn/pr-7/envdump/").json()["env"]
    assert "X" not in env and not any(k.startswith("SLESS_FORGE") for k in env)
    until(lambda: (job(server, "pr-7", "boom") or {}).get("phase") == "Failed", "boom", server)
    until(in_state(server, 7, "Failed", head), "pr-7 Failed: job boom failed", server)
    until(
        lambda: [s["state"] for s in statuses(trust.fake, head)][-1:] == ["failure"],
        "the failure status",
        server,
    )
    assert statuses(trust.fake, head)[-1]["description"] == "preview failed: job boom failed"
    # the production secret is nowhere: not in a response, a page, a status, a log line
    said = everything_said(server, trust.fake, "pr-7")
    nowhere(trust.prod_secret, said)
    nowhere(LOOKS_SECRET, {k: said[k] for k in ("statuses", "comments")})
    assert answer(server, "prod") == "main"


def test_approval_is_per_commit_a_push_keeps_the_approved_commit_serving(trust, setup):
    trust.fake.roles.update(carol="maintain")
    server = trust.serve("approved")
    v1 = trust.open_fork(server, 7, "fork v1")
    trust.label(server, 7, v1, by="carol")
    server.sync()
    until(lambda: answer(server, "pr-7") == "fork v1", "pr-7 serving v1", server)
    # greet's replica (the other functions' jobs come and go)
    pids = [pid for pid, name in processes(setup.state, "pr-7").items() if name == CHANGED]
    assert pids

    # mallory pushes v2: v1 keeps serving, v2 waits for its own approval
    v2 = trust.push_fork(server, 7, "fork v2")
    serving = f"serving {v1[:12]} while head {v2[:12]} waits"
    row = until(waiting_for(server, 7, serving), "pr-7 pinned to v1", server)
    assert row["head"] == v2 and f"at commit {v2[:12]}" in row["reason"]
    until(
        lambda: {s["state"] for s in statuses(trust.fake, v2)} == {"pending"},
        "v2's pending status",
        server,
    )
    for _ in range(3):  # more passes change nothing
        server.sync()
        assert answer(server, "pr-7") == "fork v1"
    assert all(alive(pid) for pid in pids)
    # the label is still on the PR: mallory's label event approves nothing either
    trust.label(server, 7, v2, by="mallory")
    server.sync()
    until(waiting_for(server, 7, "mallory has no write access"), "mallory refused", server)
    assert answer(server, "pr-7") == "fork v1"

    # carol adds the label again at v2
    trust.label(server, 7, v2, by="carol")
    server.sync()
    until(lambda: answer(server, "pr-7") == "fork v2", "pr-7 serving v2", server)
    # its own state now (job boom fails), no longer the approved v1's
    row = until(in_state(server, 7, "Failed", v2), "pr-7 at v2", server)
    until(lambda: preview(server, 7)["reason"] == "job boom failed", "v2's own reason", server)


def waiting_for(server: SlessServer, number: int, words: str):
    """A check: the preview's reason names ``words`` (whatever its state)."""

    def check() -> dict[str, Any] | None:
        row = preview(server, number)
        return row if row and words in (row["reason"] or "") else None

    return check


def test_all_runs_the_fork_and_still_gives_it_no_production_secret(trust, setup):
    server = trust.serve("all")
    head = trust.open_fork(server, 7, "fork v1")
    until(lambda: answer(server, "pr-7") == "fork v1", "pr-7 serving: all trusts it", server)
    until(lambda: fn_status(server, "pr-7", "leak")["phase"] == "Pending", "leak Pending", server)
    assert fn_status(server, "pr-7", "leak")["message"].startswith(NOT_AVAILABLE)
    until(lambda: (job(server, "pr-7", "leak-job") or {}).get("phase") == "Pending", "job", server)
    until(in_state(server, 7, "Failed", head), "pr-7 Failed: job boom failed", server)
    nowhere(trust.prod_secret, everything_said(server, trust.fake, "pr-7"))


def test_a_pr_known_only_from_its_ref_waits_for_its_origin(setup):
    setup.push_main(function(CHANGED, "main"))
    server = setup.serve(trust="same-repo")
    before = builds(server)
    head = setup.open(server, 5, {f"{CHANGED}/handler.py": "def main(event):\n    return 1\n"})
    row = until(waiting_because(server, 5, ORIGIN_UNKNOWN), "pr-5 origin unknown", server)
    assert row["head"] == head
    server.sync()
    assert builds(server) == before
    assert answer(server, "pr-5") is None
    # the same-repo webhook tells where it comes from: it runs
    assert send(server, "github", github_pull("opened", 5, head), "pull_request").status_code == 202
    until(in_state(server, 5, "Ready", head), "pr-5 Ready", server)


@pytest.mark.parametrize("inside", ["", "previews"])
def test_preview_secrets_inside_the_production_secrets_are_refused(tmp_path, inside):
    prod = tmp_path / "secrets"
    (prod / "previews").mkdir(parents=True)
    (tmp_path / "functions").mkdir()
    proc = serve_command(
        tmp_path,
        "--repo",
        str(tmp_path / "functions"),
        "--previews",
        "--secrets-dir",
        str(prod),
        "--preview-secrets-dir",
        str(prod / inside),
    )
    assert_refused(proc, "--preview-secrets-dir", "is in --secrets-dir")


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        pytest.param(["--preview-trust", "forks"], {}, ["--preview-trust", "same-repo"], id="flag"),
        pytest.param([], {"SLESS_PREVIEW_TRUST": "everyone"}, ["SLESS_PREVIEW_TRUST"], id="env"),
    ],
)
def test_an_unknown_trust_level_is_refused(tmp_path, args, env, words):
    (tmp_path / "functions").mkdir()
    proc = serve_command(tmp_path, "--repo", str(tmp_path / "functions"), *args, env=env)
    assert proc.returncode == 2, proc.stderr
    for word in words:
        assert word in proc.stderr


def test_the_command_line_knows_the_same_trust_levels():
    assert cli._TRUST_LEVELS == TRUST_LEVELS


# --- Previews in process ----------------------------------------------------------------------


@pytest.fixture
def kit(tmp_path: Path) -> Iterator[SimpleNamespace]:
    store = Store(tmp_path / "status.db")
    made: dict[int, ReconcilerDouble] = {}

    def make(env: str, source: PinnedSource) -> Any:
        made[int(env[3:])] = ReconcilerDouble(env, source)
        return made[int(env[3:])]

    found = SimpleNamespace(
        mirror=MirrorDouble(), backend=BackendDouble(), store=store, made=made, built=[]
    )

    def previews(**config: Any) -> Previews:
        options = {k: config.pop(k) for k in ("forge", "reporter") if k in config}
        found.previews = Previews(
            found.mirror,
            found.backend,
            store,
            RouteTable(),
            PreviewConfig(**config),
            make,
            **options,
        )
        return found.previews

    found.make = previews
    yield found
    store.close()


def served(kit: SimpleNamespace, number: int) -> str | None:
    """The commit ``pr-<number>``'s last pass ran, or None when none ran."""
    reconciler = kit.made.get(number)
    return reconciler.synced[-1] if reconciler and reconciler.synced else None


def fork(number: int, sha: str, **fields: Any) -> PullRequest:
    return PullRequest(number, "open", sha, "main", same_repo=False, **fields)


def labelled(number: int, sha: str, by: str, **fields: Any) -> PullRequest:
    return fork(number, sha, labels=(APPROVE,), labels_added=(APPROVE,), sender=by, **fields)


@pytest.mark.parametrize(
    ("trust", "event", "runs", "reason"),
    [
        pytest.param("same-repo", None, False, ORIGIN_UNKNOWN, id="same-repo-ref-only"),
        pytest.param("same-repo", fork(4, NEW), False, "from a fork", id="same-repo-fork"),
        pytest.param(
            "same-repo",
            PullRequest(4, "open", NEW, "main", same_repo=True),
            True,
            None,
            id="same-repo-same",
        ),
        pytest.param("approved", None, False, ORIGIN_UNKNOWN, id="approved-ref-only"),
        pytest.param(
            "approved", fork(4, NEW), False, "approving needs SLESS_FORGE_TOKEN", id="no-token"
        ),
        pytest.param("all", None, True, None, id="all-ref-only"),
        pytest.param("all", fork(4, NEW), True, None, id="all-fork"),
    ],
)
def test_who_runs_under_each_trust_level(kit, trust, event, runs, reason):
    kit.mirror.heads[4] = NEW
    previews = kit.make(trust=trust)
    if event is not None:
        previews.on_event(event)
    previews.run_pass()
    row = kit.store.preview(4)
    assert (served(kit, 4) == NEW) is runs
    assert row["state"] == ("Ready" if runs else "Waiting")
    assert (reason or "") in (row["reason"] or "")
    assert runs or reason is not None


def test_a_label_approves_only_when_its_author_may_write_and_only_its_commit(kit):
    reporter = ReporterDouble()
    forge = ForgeDouble([], writers=("carol",))
    kit.mirror.heads[4] = OLD
    previews = kit.make(trust="approved", forge=forge, reporter=reporter)
    previews.on_event(fork(4, OLD))
    previews.run_pass()
    assert served(kit, 4) is None
    assert reporter.said[-1].state == "Waiting"  # the PR says it waits for approval

    previews.on_event(labelled(4, OLD, "mallory"))
    previews.run_pass()
    assert served(kit, 4) is None
    assert "mallory has no write access" in kit.store.preview(4)["reason"]

    previews.on_event(labelled(4, OLD, "carol"))
    previews.run_pass()
    assert served(kit, 4) == OLD
    row = kit.store.preview(4)
    assert (row["approved"], row["approved_by"]) == (OLD, "carol")

    # a push: the approved commit keeps serving, the new head waits (and says so)
    kit.mirror.heads[4] = NEW
    previews.on_event(fork(4, NEW, labels=(APPROVE,)))
    previews.run_pass()
    assert served(kit, 4) == OLD
    assert f"serving {OLD[:12]} while head {NEW[:12]} waits" in kit.store.preview(4)["reason"]
    assert (reporter.said[-1].sha, reporter.said[-1].state) == (NEW, "Waiting")

    previews.on_event(labelled(4, NEW, "carol"))
    previews.run_pass()
    assert served(kit, 4) == NEW
    assert kit.store.preview(4)["reason"] is None


def test_an_approval_waits_while_the_forge_cannot_say_who_may_write(kit):
    class Down(ForgeDouble):
        def can_write(self, user: str, user_id: int | None = None) -> bool:
            from gitops_sless.errors import ForgeUnavailable

            raise ForgeUnavailable("github API GET: 503")

    forge = Down([], writers=("carol",))
    kit.mirror.heads[4] = OLD
    previews = kit.make(trust="approved", forge=forge)
    previews.on_event(labelled(4, OLD, "carol"))
    previews.run_pass()
    assert served(kit, 4) is None
    assert kit.store.preview(4)["approval_request"]  # asked again next pass
    forge.__class__ = ForgeDouble  # the forge is back
    previews.run_pass()
    assert served(kit, 4) == OLD


def test_a_preview_no_longer_allowed_is_taken_down_and_kept_listed(kit):
    """Restarted with a stricter --preview-trust: what ran for a fork goes."""
    kit.mirror.heads[4] = NEW
    loose = kit.make(trust="all")
    loose.on_event(fork(4, NEW))
    loose.run_pass()
    assert served(kit, 4) == NEW
    kit.store.set_function("pr-4", CHANGED, phase="Ready")  # what the pass recorded
    strict = kit.make(trust="same-repo")  # the restarted server
    strict.run_pass()
    assert "pr-4" in kit.backend.removed
    assert kit.store.functions("pr-4") == []
    row = kit.store.preview(4)
    assert row["state"] == "Waiting" and "from a fork" in row["reason"]


def test_the_label_filter_selects_the_commit_it_was_added_at(kit):
    kit.mirror.heads[4] = OLD
    previews = kit.make(trust="all", label="deploy-me")
    same = {"same_repo": True, "sender": "alice"}
    previews.on_event(PullRequest(4, "open", OLD, "main", **same))
    previews.run_pass()
    assert served(kit, 4) is None
    assert 'no label "deploy-me"' in kit.store.preview(4)["reason"]
    previews.on_event(
        PullRequest(
            4, "open", OLD, "main", labels=("deploy-me",), labels_added=("deploy-me",), **same
        )
    )
    previews.run_pass()
    assert served(kit, 4) == OLD
    # labelled at v1, a push of v2 is not previewed until the label is added again
    kit.mirror.heads[4] = NEW
    previews.on_event(PullRequest(4, "open", NEW, "main", labels=("deploy-me",), **same))
    previews.run_pass()
    assert served(kit, 4) == OLD
    assert "add it again" in kit.store.preview(4)["reason"]
    previews.on_event(
        PullRequest(
            4, "open", NEW, "main", labels=("deploy-me",), labels_added=("deploy-me",), **same
        )
    )
    previews.run_pass()
    assert served(kit, 4) == NEW


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        pytest.param({"label": "deploy-me"}, "labels unknown", id="label"),
        pytest.param({"base": "release", "base_from_filter": True}, "base is unknown", id="base"),
        pytest.param({"branch": "feature/*"}, "head branch is unknown", id="branch"),
    ],
)
def test_a_filter_a_ref_cannot_answer_fails_closed(kit, config, reason):
    kit.mirror.heads[4] = NEW
    previews = kit.make(trust="all", **config)
    previews.run_pass()
    assert served(kit, 4) is None
    row = kit.store.preview(4)
    assert row["state"] == "Waiting" and reason in row["reason"]


def test_the_default_base_lets_a_ref_only_pr_through_under_all(kit):
    kit.mirror.heads[4] = NEW
    kit.make(trust="all", base="main").run_pass()
    assert served(kit, 4) == NEW


# --- the rules, pure ------------------------------------------------------------------------


def test_decide_serves_the_approved_commit_while_the_head_waits():
    gate = Gate("approved", APPROVE, None, can_approve=True)
    row = {"same_repo": 0, "approved": OLD}
    assert decide(row, OLD, gate).commit == OLD
    pinned = decide(row, NEW, gate)
    assert pinned.commit == OLD and pinned.pinned
    assert decide({"same_repo": 0}, NEW, gate).commit is None
    # approval means nothing without a way to check who gave it
    no_token = Gate("approved", APPROVE, None, can_approve=False)
    assert decide(row, OLD, no_token).commit is None


@pytest.mark.parametrize(
    ("before", "after", "added", "previous", "expected"),
    [
        pytest.param((), ("l",), ("l",), None, NEW, id="added"),
        pytest.param((), ("l",), None, None, NEW, id="first-seen"),
        pytest.param(("l",), ("l",), (), OLD, OLD, id="stays-at-its-commit"),
        pytest.param(("l",), ("l",), None, OLD, OLD, id="a-list-that-still-has-it"),
        pytest.param(("l",), ("l",), ("l",), OLD, NEW, id="added-again"),
        pytest.param(("l",), (), (), OLD, None, id="removed"),
    ],
)
def test_label_commit(before, after, added, previous, expected):
    assert label_commit("l", before, after, added, NEW, previous) == expected


def test_a_preview_report_carries_names_states_and_links_only():
    report = PreviewReport(
        env="pr-7",
        sha=NEW,
        state="Failed",
        url="http://sless.example/fn/pr-7/",
        functions=(
            ("greet", "Ready", "http://sless.example/fn/pr-7/greet/"),
            ("cron", "Failed", None),
        ),
        failures=("cron: build failed", "job notes-create-table failed"),
    )
    assert report.forge_state == "failure"
    assert report.description == (
        "preview failed: cron: build failed; job notes-create-table failed"
    )
    assert report.comment.splitlines() == [
        f"**Preview `pr-7`** at `{NEW[:12]}`: Failed",
        "- cron: build failed",
        "- job notes-create-table failed",
        "",
        "- `greet`: Ready — http://sless.example/fn/pr-7/greet/",
        "- `cron`: Failed",
    ]
    waiting = PreviewReport("pr-7", NEW, "Waiting", "u", note="from a fork: waits")
    assert (waiting.forge_state, waiting.description) == (
        "pending",
        "preview waiting: from a fork: waits",
    )
