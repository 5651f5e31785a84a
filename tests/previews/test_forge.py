"""The forge REST clients against a loopback imitation of GitHub, Gitea and GitLab.

``FakeForge`` answers the endpoints the clients use, the way each forge shapes them
(paths, auth header, page parameters, ``Link``/``X-Next-Page`` headers, object
shapes), keeps pulls, statuses and comments in memory, records every call, and can
be told to fail the next matching calls (``fail``) or to hold answers (``gate``).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import pytest

from gitops_sless.errors import ForgeRefused, ForgeUnavailable, PermanentError, TransientError
from gitops_sless.previews.forge import KINDS, Forge, forge_for
from gitops_sless.previews.pulls import PullRequest

PREFIX = {"github": "", "gitea": "/api/v1", "gitlab": "/api/v4"}
REPO = {"github": "/repos/acme/functions", "gitea": "/repos/acme/functions"}
REPO["gitlab"] = "/projects/acme%2Ffunctions"  # the project path, URL-encoded
SHA = "c0ffee5d2b1e4f6a8b9c0d1e2f3a4b5c6d7e8f90"
MARKER = "gitops-sless:preview"


@dataclass
class Call:
    method: str
    path: str  # raw, as sent: %2F stays encoded
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class Failure:
    method: str
    path_part: str
    status: int
    headers: dict[str, str]
    times: int


@dataclass
class FakeForge:
    kind: str
    token: str
    url: str = ""
    page_cap: int = 2  # the server's own page size limit: forces several pages
    pulls: list[dict[str, Any]] = field(default_factory=list)
    comments: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    statuses: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    gate: threading.Event | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_id: int = 1000
    # user -> role (admin, maintain, write, triage, read); absent: not a collaborator
    roles: dict[str, str] = field(default_factory=dict)
    # commit -> the pull requests it belongs to (the merged one that brought it)
    commit_pulls: dict[str, list[int]] = field(default_factory=dict)

    def fail(
        self, method: str, path_part: str, status: int, headers: dict[str, str] | None = None
    ) -> None:
        self.failures.append(Failure(method, path_part, status, headers or {}, 1))

    def add_pull(
        self,
        number: int,
        state: str = "open",
        labels: tuple[str, ...] = (),
        origin: str | None = None,
    ) -> None:
        """A pull request; ``origin`` "same" or "fork" adds where its head lives (the
        repository objects, or GitLab's project ids), None leaves them out."""
        sha = f"{number:040x}"
        if self.kind == "gitlab":
            self.pulls.append(
                {
                    "id": 9000 + number,
                    "iid": number,
                    "state": {"open": "opened"}.get(state, state),
                    "sha": sha,
                    "title": f"change {number}",
                    "author": {"id": 4, "username": "alice"},
                    "source_branch": f"feature-{number}",
                    "target_branch": "main",
                    "labels": list(labels),
                    **(
                        {
                            "source_project_id": 99 if origin == "fork" else 15,
                            "target_project_id": 15,
                        }
                        if origin
                        else {}
                    ),
                }
            )
        else:
            head: dict[str, Any] = {"ref": f"feature-{number}", "sha": sha}
            base: dict[str, Any] = {"ref": "main", "sha": "0" * 40}
            if origin:
                owner = "mallory" if origin == "fork" else "acme"
                head["repo"] = {
                    "id": 2 if origin == "fork" else 1,
                    "full_name": f"{owner}/functions",
                }
                base["repo"] = {"id": 1, "full_name": "acme/functions"}
            self.pulls.append(
                {
                    "id": 9000 + number,
                    "number": number,
                    "state": state,
                    "title": f"change {number}",
                    "user": {"login": "alice", "id": 4},
                    "head": head,
                    "base": base,
                    "labels": [{"id": 1, "name": name} for name in labels],
                    "merged_at": None,
                }
            )

    def user_id(self, user: str) -> int:
        """The id the imitation gives ``user`` (stable, one per name)."""
        return 100 + sorted({*self.roles, user}).index(user) if user in self.roles else 99_999

    def add_comment(self, number: int, user: str, body: str, system: bool = False) -> int:
        self.next_id += 1
        author = {"username": user} if self.kind == "gitlab" else {"login": user}
        comment = {
            "id": self.next_id,
            "body": body,
            ("author" if self.kind == "gitlab" else "user"): author,
        }
        if self.kind == "gitlab":
            comment["system"] = system
        self.comments.setdefault(number, []).append(comment)
        return self.next_id

    def writes(self) -> list[Call]:
        return [c for c in self.calls if c.method != "GET"]

    # --- the server side

    def authorized(self, headers: dict[str, str]) -> bool:
        if self.kind == "gitlab":
            return headers.get("private-token") == self.token
        scheme = "Bearer" if self.kind == "github" else "token"
        return headers.get("authorization") == f"{scheme} {self.token}"

    def answer(self, call: Call) -> tuple[int, dict[str, str], Any]:
        if self.gate is not None:
            self.gate.wait(10)
        with self.lock:
            for failure in self.failures:
                if (
                    failure.times
                    and call.method == failure.method
                    and failure.path_part in call.path
                ):
                    failure.times -= 1
                    return failure.status, failure.headers, {"message": "scripted failure"}
        if not self.authorized(call.headers):
            # a careless server echoing what it got: the client must not repeat it anywhere
            given = call.headers.get("authorization") or call.headers.get("private-token")
            return 401, {}, {"message": f"Bad credentials: {given}"}
        if self.kind == "gitlab" and call.path == "/api/v4/users":
            name = call.query.get("username", "")
            found = [{"id": self.user_id(name), "username": name}] if name in self.roles else []
            return 200, {}, found
        prefix = PREFIX[self.kind] + REPO[self.kind]
        if not call.path.startswith(prefix):
            return 404, {}, {"message": "Not Found"}
        rest = call.path.removeprefix(prefix).strip("/").split("/")
        with self.lock:
            return self.route(call, rest)

    def route(self, call: Call, rest: list[str]) -> tuple[int, dict[str, str], Any]:
        gitlab = self.kind == "gitlab"
        if call.method == "GET" and rest == ["merge_requests" if gitlab else "pulls"]:
            wanted = call.query.get("state")
            items = [p for p in self.pulls if p["state"] == wanted]
            return self.page(call, items)
        if (
            call.method == "GET"
            and len(rest) == 2
            and rest[0] == ("merge_requests" if gitlab else "pulls")
        ):
            return self.one_pull(rest[1:])
        if call.method == "POST" and rest[0] == "statuses" and len(rest) == 2:
            key = "name" if gitlab else "context"
            last = [s for sha, s in self.statuses if sha == rest[1] and s[key] == call.body[key]]
            if gitlab and last and last[-1]["state"] == call.body["state"]:
                message = f"Cannot transition status via :enqueue from :{call.body['state']}"
                return 400, {}, {"message": message}
            self.statuses.append((rest[1], call.body))
            return 201, {}, {"id": len(self.statuses), **call.body}
        if gitlab and rest[0] == "merge_requests" and rest[2:3] == ["notes"]:
            return self.comment_call(call, int(rest[1]), rest[3:])
        if not gitlab and rest[0] == "issues" and rest[2:3] == ["comments"]:
            return self.comment_call(call, int(rest[1]), [])
        if not gitlab and rest[:2] == ["issues", "comments"] and call.method == "PATCH":
            return self.comment_call(call, None, rest[2:])
        if call.method == "GET" and not gitlab and rest[0] == "collaborators" and len(rest) == 3:
            return self.permission(rest[1])
        if call.method == "GET" and gitlab and rest[:2] == ["members", "all"] and len(rest) == 3:
            return self.member(int(rest[2]))
        commit_pulls = {"github": "pulls", "gitea": "pull", "gitlab": "merge_requests"}[self.kind]
        if call.method == "GET" and gitlab and rest[:2] == ["repository", "commits"]:
            rest = rest[1:]  # GitLab's commits live under repository/
        if call.method == "GET" and rest[0] == "commits" and rest[2:] == [commit_pulls]:
            return self.pulls_of(call, rest[1])
        return 404, {}, {"message": "Not Found"}

    def pulls_of(self, call: Call, sha: str) -> tuple[int, dict[str, str], Any]:
        """GitHub's ``commits/{sha}/pulls`` and GitLab's ``repository/commits/{sha}/
        merge_requests`` (paged lists), Gitea's ``commits/{sha}/pull`` (one, or 404)."""
        numbers = self.commit_pulls.get(sha, [])
        if self.kind == "gitlab":
            items = [{"id": 9000 + n, "iid": n, "state": "merged"} for n in numbers]
        else:
            items = [{"id": 9000 + n, "number": n, "state": "closed"} for n in numbers]
        if self.kind == "gitea":
            return (200, {}, items[0]) if items else (404, {}, {"message": "Not Found"})
        return self.page(call, items)

    def permission(self, user: str) -> tuple[int, dict[str, str], Any]:
        """GitHub's and Gitea's ``collaborators/{user}/permission``."""
        role = self.roles.get(user)
        if role is None:  # GitHub: anyone may read a public repository; Gitea: not found
            return (
                (200, {}, {"permission": "read", "role_name": "read"})
                if (self.kind == "github")
                else (404, {}, {"message": "Not Found"})
            )
        # GitHub's legacy "permission" knows admin, write and read; role_name says more
        legacy = {"maintain": "write", "triage": "read"}.get(role, role)
        if self.kind == "gitea":
            legacy = {"admin": "owner"}.get(role, legacy)
        return 200, {}, {"permission": legacy, "role_name": role, "user": {"login": user}}

    def member(self, user_id: int) -> tuple[int, dict[str, str], Any]:
        """GitLab's ``members/all/{id}``: access levels 10 (guest) to 50 (owner)."""
        levels = {"read": 10, "triage": 20, "write": 30, "maintain": 40, "admin": 50}
        for user, role in self.roles.items():
            if self.user_id(user) == user_id:
                return 200, {}, {"id": user_id, "username": user, "access_level": levels[role]}
        return 404, {}, {"message": "404 Not found"}

    def one_pull(self, rest: list[str]) -> tuple[int, dict[str, str], Any]:
        """``GET pulls/N`` (``merge_requests/IID``): the last pull listed under that number."""
        key = "iid" if self.kind == "gitlab" else "number"
        found = [p for p in self.pulls if len(rest) == 1 and str(p[key]) == rest[0]]
        return (200, {}, found[-1]) if found else (404, {}, {"message": "Not Found"})

    def comment_call(
        self, call: Call, number: int | None, rest: list[str]
    ) -> tuple[int, dict[str, str], Any]:
        if call.method == "GET" and not rest and number is not None:
            items = self.comments.get(number, [])
            return self.page(call, items) if self.kind != "gitea" else (200, {}, items)
        if call.method == "POST" and not rest and number is not None:
            self.next_id += 1
            author = {"username": "sless-bot"} if self.kind == "gitlab" else {"login": "sless-bot"}
            key = "author" if self.kind == "gitlab" else "user"
            comment = {"id": self.next_id, "body": call.body["body"], key: author}
            self.comments.setdefault(number, []).append(comment)
            return 201, {}, comment
        if call.method in ("PATCH", "PUT") and len(rest) == 1:
            for comment in (c for cs in self.comments.values() for c in cs):
                if comment["id"] == int(rest[0]):
                    comment["body"] = call.body["body"]
                    return 200, {}, comment
        return 404, {}, {"message": "Not Found"}

    def page(self, call: Call, items: list[Any]) -> tuple[int, dict[str, str], Any]:
        size_key = "limit" if self.kind == "gitea" else "per_page"
        size = min(int(call.query.get(size_key, 30)), self.page_cap)
        page = int(call.query.get("page", 1))
        last = max(1, -(-len(items) // size))
        # Gitea writes links with its ROOT_URL, which need not be where the client calls
        origin = "https://gitea.invalid" if self.kind == "gitea" else self.url
        links = []
        if page < last:
            links.append(
                f'<{origin}{call.path}?{urlencode({**call.query, "page": page + 1})}>; rel="next"'
            )
        links.append(f'<{origin}{call.path}?{urlencode({**call.query, "page": last})}>; rel="last"')
        headers = {"Link": ", ".join(links)}
        if self.kind == "gitlab":  # GitLab sends both; X-Next-Page is empty on the last page
            headers["X-Next-Page"] = str(page + 1) if page < last else ""
        if self.kind == "gitea":
            headers["X-Total-Count"] = str(len(items))
        return 200, headers, items[(page - 1) * size : page * size]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        call = Call(
            self.command,
            parts.path,
            dict(parse_qsl(parts.query)),
            {k.lower(): v for k, v in self.headers.items()},
            json.loads(raw) if raw else None,
        )
        forge = self.server.forge
        with forge.lock:
            forge.calls.append(call)
        status, headers, body = forge.answer(call)
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_PUT = _serve


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    forge: FakeForge


def serve(kind: str) -> tuple[FakeForge, _Server]:
    """A FakeForge of ``kind`` on a free loopback port (stop it with ``shutdown``)."""
    forge = FakeForge(kind, token=f"tok-{secrets.token_hex(12)}")
    server = _Server(("127.0.0.1", 0), _Handler)
    server.forge = forge
    forge.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return forge, server


@pytest.fixture(params=KINDS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[FakeForge, Forge]]:
    """(the imitation, a client for it) for GitHub, Gitea and GitLab."""
    fake, server = serve(request.param)
    client = make_client(fake)
    yield fake, client
    client.close()
    server.shutdown()
    server.server_close()


def make_client(fake: FakeForge, **options: Any) -> Forge:
    host = {"github": "github.com", "gitea": "gitea.example.com", "gitlab": "gitlab.example.com"}
    options = {"backoff": 0.01, **options}
    return forge_for(
        f"https://{host[fake.kind]}/acme/functions.git", fake.token, api_url=fake.url, **options
    )


def test_open_pulls_reads_every_page(served):
    fake, client = served
    for number in (3, 5, 8):
        fake.add_pull(number, labels=("preview",) if number == 5 else ())
    fake.add_pull(2, state="closed")
    pulls = client.open_pulls()
    assert [p.number for p in pulls] == [3, 5, 8]
    assert pulls[1] == PullRequest(
        5, "open", f"{5:040x}", "main", "change 5", "alice", "feature-5", ("preview",), False
    )
    gets = [c for c in fake.calls if c.method == "GET"]
    assert len(gets) == 2
    assert {c.path for c in gets} == {
        PREFIX[fake.kind]
        + REPO[fake.kind]
        + ("/merge_requests" if fake.kind == "gitlab" else "/pulls")
    }
    first = gets[0].query
    assert (
        first
        == {
            "github": {"state": "open", "per_page": "100"},
            "gitea": {"state": "open", "limit": "50"},
            "gitlab": {"state": "opened", "per_page": "100"},
        }[fake.kind]
    )
    assert gets[1].query == {**first, "page": "2"}


def test_pull_reads_one_pull_request_as_the_forge_has_it_now(served):
    fake, client = served
    fake.add_pull(5, labels=("preview",))
    fake.add_pull(6, state="closed")
    assert client.pull(5) == PullRequest(
        5, "open", f"{5:040x}", "main", "change 5", "alice", "feature-5", ("preview",), False
    )
    assert client.pull(6).state == "closed"
    assert client.pull(7) is None  # the forge answers 404: no such pull request
    gets = [c.path for c in fake.calls if c.method == "GET"]
    kind = "merge_requests" if fake.kind == "gitlab" else "pulls"
    base = PREFIX[fake.kind] + REPO[fake.kind]
    assert gets == [f"{base}/{kind}/5", f"{base}/{kind}/6", f"{base}/{kind}/7"]


@pytest.mark.parametrize(
    ("role", "may"),
    [
        ("admin", True),
        ("maintain", True),
        ("write", True),
        ("triage", False),
        ("read", False),
        (None, False),  # not a collaborator at all
    ],
)
def test_can_write_only_for_write_maintain_and_admin(served, role, may):
    fake, client = served
    if role is not None:
        fake.roles["carol"] = role
    fake.roles["someone-else"] = "admin"
    assert client.can_write("carol") is may
    # the id a webhook gives (GitLab asks for members by id, no lookup then)
    assert client.can_write("carol", fake.user_id("carol")) is may


def test_can_write_names_the_user_in_the_path_escaped(served):
    fake, client = served
    fake.roles["carol"] = "write"
    assert client.can_write("../../carol") is False
    paths = [c.path for c in fake.calls]
    assert all("/../" not in path for path in paths), paths


def test_can_write_when_the_forge_is_down_is_unavailable(served):
    fake, client = served
    fake.roles["carol"] = "write"
    for _ in range(10):
        fake.fail("GET", "/", 503)
    with pytest.raises(ForgeUnavailable):
        client.can_write("carol", fake.user_id("carol"))


def test_auth_header_per_forge(served):
    fake, client = served
    client.open_pulls()
    headers = fake.calls[0].headers
    expected = {
        "github": ("authorization", f"Bearer {fake.token}"),
        "gitea": ("authorization", f"token {fake.token}"),
        "gitlab": ("private-token", fake.token),
    }[fake.kind]
    assert headers[expected[0]] == expected[1]


def test_set_status(served):
    fake, client = served
    client.set_status(
        SHA, "pending", "gitops-sless/preview", "Building 2 functions", "https://sless.example/pr-5"
    )
    client.set_status(SHA, "failure", "gitops-sless/preview", "x" * 300, None)
    (call1, call2) = fake.writes()
    assert call1.method == "POST"
    assert call1.path == PREFIX[fake.kind] + REPO[fake.kind] + f"/statuses/{SHA}"
    if fake.kind == "gitlab":
        assert call1.body == {
            "state": "pending",
            "name": "gitops-sless/preview",
            "description": "Building 2 functions",
            "target_url": "https://sless.example/pr-5",
        }
        assert call2.body["state"] == "failed"
    else:
        assert call1.body == {
            "state": "pending",
            "context": "gitops-sless/preview",
            "description": "Building 2 functions",
            "target_url": "https://sless.example/pr-5",
        }
        assert call2.body["state"] == "failure"
    assert len(call2.body["description"]) == 140
    assert call2.body["description"] == "x" * 139 + "…"  # a cut description says so
    assert "target_url" not in call2.body


def test_a_description_within_the_limit_is_sent_whole(served):
    fake, client = served
    client.set_status(SHA, "failure", "ctx", "y" * 140, None)
    assert fake.writes()[0].body["description"] == "y" * 140


def test_pulls_of_names_the_pull_requests_a_commit_belongs_to(served):
    fake, client = served
    fake.commit_pulls[SHA] = [12]
    assert client.pulls_of(SHA) == [12]
    (call,) = fake.calls
    assert call.method == "GET"
    assert (
        call.path
        == PREFIX[fake.kind]
        + REPO[fake.kind]
        + {
            "github": f"/commits/{SHA}/pulls",
            "gitea": f"/commits/{SHA}/pull",
            "gitlab": f"/repository/commits/{SHA}/merge_requests",
        }[fake.kind]
    )


def test_pulls_of_a_commit_pushed_directly_is_none(served):
    _, client = served
    assert client.pulls_of(SHA) == []  # Gitea: 404, the others: an empty list


@pytest.mark.parametrize("kind", ["github", "gitlab"])
def test_pulls_of_reads_every_page(kind):
    fake, server = serve(kind)  # two to a page
    try:
        fake.commit_pulls[SHA] = [3, 5, 8]
        client = make_client(fake)
        assert client.pulls_of(SHA) == [3, 5, 8]
        assert len(fake.calls) == 2
    finally:
        server.shutdown()
        server.server_close()


def test_pulls_of_refuses_what_is_not_a_sha(served):
    fake, client = served
    with pytest.raises(ValueError, match="sha"):
        client.pulls_of("../../user")
    assert fake.calls == []


def test_pulls_of_when_the_forge_is_down_is_unavailable(served):
    fake, client = served
    for _ in range(4):
        fake.fail("GET", "/commits/", 503)
    with pytest.raises(ForgeUnavailable):
        client.pulls_of(SHA)


def test_status_arguments_are_checked(served):
    _, client = served
    with pytest.raises(ValueError, match="sha"):
        client.set_status("../../user", "success", "c", "d", None)
    with pytest.raises(ValueError, match="use one of"):
        client.set_status(SHA, "running", "c", "d", None)


def test_gitlab_same_status_twice_is_no_error():
    fake, server = serve("gitlab")
    try:
        client = make_client(fake)
        client.set_status(SHA, "success", "ctx", "ok", None)
        client.set_status(SHA, "success", "ctx", "ok", None)  # GitLab answers 400 here
        assert len(fake.writes()) == 2
        assert len(fake.statuses) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_upsert_comment_creates_once_then_edits_in_place(served):
    fake, client = served
    other = fake.add_comment(5, "carol", "LGTM")
    quoting = fake.add_comment(5, "dave", f"> <!-- {MARKER} -->\n> Preview ready")
    if fake.kind == "gitlab":
        fake.add_comment(5, "alice", f"<!-- {MARKER} --> added 1 commit", system=True)
    client.upsert_comment(5, MARKER, "Preview: building")
    fake.add_comment(5, "erin", "one more comment after ours")
    client.upsert_comment(5, MARKER, "Preview: ready at https://sless.example/pr-5")
    client.upsert_comment(5, MARKER, "Preview: ready at https://sless.example/pr-5")  # no change
    writes = fake.writes()
    assert [c.method for c in writes] == ["POST", "PUT" if fake.kind == "gitlab" else "PATCH"]
    ours = [
        c
        for c in fake.comments[5]
        if c["body"].startswith(f"<!-- {MARKER} -->") and not c.get("system")
    ]
    assert len(ours) == 1
    assert ours[0]["body"] == f"<!-- {MARKER} -->\nPreview: ready at https://sless.example/pr-5"
    assert writes[1].path.endswith(f"/{ours[0]['id']}")
    bodies = {c["id"]: c["body"] for c in fake.comments[5]}
    assert bodies[other] == "LGTM"
    assert bodies[quoting].startswith("> ")


def test_upsert_comment_pages_through_comments(served):
    fake, client = served
    for i in range(5):
        fake.add_comment(9, "carol", f"comment {i}")
    ours = fake.add_comment(9, "sless-bot", f"<!-- {MARKER} -->\nold")
    client.upsert_comment(9, MARKER, "new")
    (write,) = fake.writes()
    assert write.path.endswith(f"/{ours}")


def test_a_failed_comment_post_is_not_resent(served):
    fake, client = served
    fake.fail("POST", "/comments" if fake.kind != "gitlab" else "/notes", 502)
    with pytest.raises(ForgeUnavailable):
        client.upsert_comment(5, MARKER, "hello")
    assert [c.method for c in fake.writes()] == ["POST"]


def test_429_with_retry_after_is_waited_and_retried(served):
    fake, _ = served
    fake.add_pull(1)
    fake.fail("GET", "", 429, {"Retry-After": "1"})
    waits: list[float] = []  # the client's sleeps, asked of an injected clock
    client = make_client(fake, sleep=waits.append)
    try:
        assert [p.number for p in client.open_pulls()] == [1]
    finally:
        client.close()
    assert waits == [1.0]  # what the server asked for, before the one retry
    assert len(fake.calls) == 2


def test_403_with_exhausted_rate_limit_waits_for_the_reset(served):
    fake, _ = served
    waits: list[float] = []
    client = make_client(fake, sleep=lambda s: (waits.append(s), time.sleep(s)))
    prefix = "" if fake.kind == "gitlab" else "X-"
    reset = str(int(time.time()) + 1)
    fake.fail(
        "POST",
        "/statuses/",
        403,
        {f"{prefix}RateLimit-Remaining": "0", f"{prefix}RateLimit-Reset": reset},
    )
    client.set_status(SHA, "success", "ctx", "ok", None)
    assert len(waits) == 1 and 1.0 <= waits[0] <= 2.0
    assert [c.method for c in fake.calls] == ["POST", "POST"]
    assert len(fake.statuses) == 1
    client.close()


def test_rate_limit_beyond_the_budget_is_unavailable_at_once(served):
    fake, _ = served
    client = make_client(fake, max_wait=5, sleep=lambda s: pytest.fail("must not wait"))
    fake.fail("GET", "", 429, {"Retry-After": "3600"})
    with pytest.raises(ForgeUnavailable, match=r"429 .*asks to wait 3600s"):
        client.open_pulls()
    client.close()


def test_403_without_rate_limit_is_unavailable(served):
    fake, client = served
    fake.fail("GET", "", 403)
    with pytest.raises(ForgeUnavailable, match="403"):
        client.open_pulls()
    assert len(fake.calls) == 1


def test_persistent_500_is_unavailable_after_a_few_tries(served):
    fake, client = served
    for _ in range(10):
        fake.fail("GET", "", 500)
    with pytest.raises(ForgeUnavailable) as caught:
        client.open_pulls()
    assert isinstance(caught.value, TransientError)
    assert len(fake.calls) == 4  # the first try and 3 retries
    message = str(caught.value)
    assert "\n" not in message and "500" in message and fake.kind in message


@pytest.mark.parametrize("status", [401, 404])
def test_401_and_404_are_permanent(served, status):
    fake, client = served
    if status == 401:
        fake.token, token = "another-token", fake.token  # the client's token is now wrong
    else:
        fake.fail("GET", "", 404)
    with pytest.raises(ForgeRefused) as caught:
        client.open_pulls()
    assert isinstance(caught.value, PermanentError)
    assert len(fake.calls) == 1
    assert str(status) in str(caught.value)
    if status == 401:
        assert token not in str(caught.value)  # the server echoed it; the message masks it


def test_network_error_is_unavailable():
    fake, server = serve("github")
    server.shutdown()
    server.server_close()
    client = make_client(fake, retries=1)
    with pytest.raises(ForgeUnavailable, match="ConnectError"):
        client.open_pulls()
    client.close()


def test_token_never_appears_in_logs(served, caplog):
    caplog.set_level(logging.DEBUG)
    fake, client = served
    fake.add_pull(1)
    fake.fail("GET", "", 429, {"Retry-After": "0"})
    fake.fail("GET", "", 500)
    client.open_pulls()
    client.set_status(SHA, "success", "ctx", "ok", None)
    client.upsert_comment(1, MARKER, "hi")
    fake.token = "changed-token"
    with pytest.raises(ForgeRefused) as caught:
        client.open_pulls()
    logging.getLogger("test").warning("failed: %s", caught.value)
    assert "retrying" in caplog.text
    token = fake.calls[0].headers.get("private-token") or fake.calls[0].headers["authorization"]
    secret = token.split()[-1]
    assert secret not in caplog.text
    assert secret not in repr(client)


@pytest.mark.parametrize(
    ("url", "kind", "shown", "base"),
    [
        (
            "https://github.com/acme/functions.git",
            None,
            "<github forge acme/functions>",
            "https://api.github.com",
        ),
        (
            "git@github.com:acme/functions.git",
            None,
            "<github forge acme/functions>",
            "https://api.github.com",
        ),
        (
            "https://ghe.corp.example/acme/functions",
            "github",
            "<github forge acme/functions>",
            "https://ghe.corp.example/api/v3",
        ),
        (
            "https://gitlab.com/group/sub/functions.git",
            None,
            "<gitlab forge group/sub/functions>",
            "https://gitlab.com/api/v4",
        ),
        (
            "ssh://git@gitlab.corp.example:2222/acme/functions.git",
            None,
            "<gitlab forge acme/functions>",
            "https://gitlab.corp.example/api/v4",
        ),
        (
            "http://user:pw@gitea.local:3000/acme/functions.git",
            None,
            "<gitea forge acme/functions>",
            "http://gitea.local:3000/api/v1",
        ),
        (
            "https://git.example.com/gitea/acme/functions.git",
            "gitea",
            "<gitea forge acme/functions>",
            "https://git.example.com/gitea/api/v1",
        ),
    ],
)
def test_forge_for_guesses_kind_and_api_base(url, kind, shown, base):
    client = forge_for(url, "some-token", kind=kind)
    assert repr(client) == shown
    assert str(client._api._client.base_url).rstrip("/") == base  # type: ignore[attr-defined]
    client.close()


def test_forge_for_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="set the forge kind"):
        forge_for("https://git.example.com/acme/functions.git", "some-token")
    with pytest.raises(ValueError, match="forge kind 'bitbucket'"):
        forge_for("https://git.example.com/acme/functions.git", "some-token", kind="bitbucket")
    with pytest.raises(ValueError, match="owner/repository"):
        forge_for("https://github.com/functions", "some-token")
    with pytest.raises(ValueError, match="token is empty"):
        forge_for("https://github.com/acme/functions", "")
    with pytest.raises(ValueError, match="no host"):
        forge_for("/srv/git/functions", "some-token")
    with pytest.raises(ValueError, match="set the forge kind") as caught:
        forge_for("https://user:s3cr3t@git.example.com/acme/functions.git", "some-token")
    assert "s3cr3t" not in str(caught.value)


def test_api_url_may_name_the_api_root_or_the_host():
    for api_url in ("https://gitea.local", "https://gitea.local/api/v1/"):
        client = forge_for("https://gitea.local/acme/functions", "some-token", api_url, "gitea")
        assert str(client._api._client.base_url) == "https://gitea.local/api/v1/"  # type: ignore[attr-defined]
        client.close()
