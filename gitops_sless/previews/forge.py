"""The forge's REST API: pull requests, commit statuses, and one comment per PR.

GitHub, Gitea and GitLab behind one :class:`Forge` protocol; :func:`forge_for` picks
the forge from the repository URL (or ``kind``) and its API base (or ``api_url``:
GitHub Enterprise, self-hosted Gitea or GitLab, tests). Transport, rate limits and
error types are :mod:`gitops_sless.previews.forgehttp`'s. Our comment on a pull request is the
one whose body starts with ``<!-- marker -->``: it is edited in place, created only
when absent, and left alone when its text is already right.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from .. import logs
from ..errors import ForgeRefused, ForgeUnavailable
from ..source.webhooks import PayloadError
from .forgehttp import ForgeHttp, error_message
from .pulls import PullRequest, pull_from_api

__all__ = ["KINDS", "STATES", "Forge", "forge_for", "trimmed"]

KINDS = ("github", "gitea", "gitlab")
STATES = ("pending", "success", "failure", "error")
_GITLAB_STATES = {
    "pending": "pending",
    "success": "success",
    "failure": "failed",
    "error": "failed",
}
# who may approve a preview of a fork: those who could push the commit themselves
_WRITE_PERMISSIONS = {"write", "maintain", "admin", "owner"}
_GITLAB_DEVELOPER = 30  # access level: Developer (push to unprotected branches) and above
_SHA = re.compile(r"^[0-9a-fA-F]{7,64}$")
_MARKER = re.compile(r"^[A-Za-z0-9_.:/ -]{1,100}$")
_DESCRIPTION_MAX = 140  # GitHub refuses longer status descriptions


class Forge(Protocol):
    """What the reconciler asks of a forge."""

    def open_pulls(self) -> list[PullRequest]:
        """Every open pull (merge) request, all pages."""
        ...

    def pull(self, number: int) -> PullRequest | None:
        """Pull (merge) request ``number`` as the forge has it now; None if it has none."""
        ...

    def set_status(
        self, sha: str, state: str, context: str, description: str, url: str | None
    ) -> None:
        """Set the commit status ``context`` of ``sha``; ``state`` is one of STATES."""
        ...

    def upsert_comment(self, number: int, marker: str, body: str) -> None:
        """Edit our comment (found by ``<!-- marker -->``) on PR ``number``, or create it."""
        ...

    def pulls_of(self, sha: str) -> list[int]:
        """The pull (merge) requests commit ``sha`` belongs to (the merged one that brought
        it, or those whose head it is), by number; [] for a commit pushed directly."""
        ...

    def can_write(self, user: str, user_id: int | None = None) -> bool:
        """Whether ``user`` may push to the repository (write, maintain or admin; GitLab:
        Developer or above). ForgeUnavailable when the forge cannot say now."""
        ...

    def close(self) -> None:
        """Release the HTTP connections."""
        ...


def _pulls(kind: str, items: list[Any]) -> list[PullRequest]:
    try:
        return [pull_from_api(kind, item) for item in items]
    except PayloadError as exc:
        raise ForgeUnavailable(f"{kind} API: {exc}") from None


def _one_pull(api: ForgeHttp, path: str) -> PullRequest | None:
    resp = api.call("GET", path, accept=(404,))
    if resp.status_code == 404:
        return None
    return _pulls(api.kind, [api.json(resp)])[0]


def _status(sha: str, state: str, description: str, url: str | None) -> dict[str, str]:
    """The fields every forge's status call shares, checked; ``url`` left out when None."""
    _checked(sha)
    if state not in STATES:
        raise ValueError(f"status {state!r}: use one of {', '.join(STATES)}")
    body = {"description": trimmed(description)}
    return {**body, "target_url": url} if url else body


def trimmed(text: str, limit: int = _DESCRIPTION_MAX) -> str:
    """``text`` within ``limit`` characters; a cut one ends with "…", so it says it was cut."""
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _checked(sha: str) -> str:
    if not _SHA.match(sha):
        raise ValueError(f"commit {sha!r} is not a hexadecimal sha")
    return sha


def _numbers(items: list[Any], key: str) -> list[int]:
    """The numbers (``key``) of the pull requests listed, each once, in order."""
    found = [item.get(key) for item in items if isinstance(item, dict)]
    return list(dict.fromkeys(n for n in found if isinstance(n, int) and n > 0))


def _marked(marker: str, body: str) -> tuple[str, str]:
    """(the hidden first line that finds our comment, the comment's whole text)."""
    if not _MARKER.match(marker):
        raise ValueError(f"comment marker {marker!r}: letters, digits, space and _.:/- only")
    head = f"<!-- {marker} -->"
    return head, f"{head}\n{body}"


def _ours(comments: list[Any], head: str) -> dict[str, Any] | None:
    """The first comment whose body starts with our marker (GitLab system notes skipped)."""
    for comment in comments:
        if not isinstance(comment, dict) or comment.get("system"):
            continue
        if str(comment.get("body") or "").startswith(head) and isinstance(comment.get("id"), int):
            return comment
    return None


class _HubForge:
    """GitHub and Gitea: the same resources, paged differently."""

    def __init__(self, api: ForgeHttp, owner: str, repo: str, page: dict[str, int]) -> None:
        self._api, self._page = api, page
        self._repo = f"/repos/{quote(owner, safe='')}/{quote(repo, safe='')}"

    def __repr__(self) -> str:
        return f"<{self._api.kind} forge {self._repo.removeprefix('/repos/')}>"

    def close(self) -> None:
        self._api.close()

    def open_pulls(self) -> list[PullRequest]:
        items = self._api.get_all(f"{self._repo}/pulls", {"state": "open", **self._page})
        return _pulls(self._api.kind, items)

    def pull(self, number: int) -> PullRequest | None:
        return _one_pull(self._api, f"{self._repo}/pulls/{int(number)}")

    def set_status(
        self, sha: str, state: str, context: str, description: str, url: str | None
    ) -> None:
        body = {**_status(sha, state, description, url), "state": state, "context": context}
        self._api.call("POST", f"{self._repo}/statuses/{sha}", body=body)

    def upsert_comment(self, number: int, marker: str, body: str) -> None:
        head, text = _marked(marker, body)
        page = self._page if self._api.kind == "github" else {}  # Gitea sends them all
        found = _ours(self._api.get_all(f"{self._repo}/issues/{int(number)}/comments", page), head)
        if found is None:
            path = f"{self._repo}/issues/{int(number)}/comments"
            self._api.call("POST", path, body={"body": text}, repeatable=False)
        elif found.get("body") != text:
            path = f"{self._repo}/issues/comments/{found['id']}"
            self._api.call("PATCH", path, body={"body": text})

    def pulls_of(self, sha: str) -> list[int]:
        if self._api.kind == "github":
            path = f"{self._repo}/commits/{_checked(sha)}/pulls"
            return _numbers(self._api.get_all(path, self._page), "number")
        # Gitea: the one pull request that brought the commit, or 404 for none
        resp = self._api.call("GET", f"{self._repo}/commits/{_checked(sha)}/pull", accept=(404,))
        return [] if resp.status_code == 404 else _numbers([self._api.json(resp)], "number")

    def can_write(self, user: str, user_id: int | None = None) -> bool:
        path = f"{self._repo}/collaborators/{quote(user, safe='')}/permission"
        resp = self._api.call("GET", path, accept=(404,))
        if resp.status_code == 404:  # no such user, or not a collaborator (Gitea)
            return False
        found = self._api.json(resp)
        if not isinstance(found, dict):
            return False
        # GitHub's "permission" folds maintain into write; Gitea says owner for the owner
        names = {found.get("permission"), found.get("role_name")}
        return bool(names & _WRITE_PERMISSIONS)


class _GitLabForge:
    def __init__(self, api: ForgeHttp, project: str) -> None:
        self._api, self._name = api, project
        self._project = f"/projects/{quote(project, safe='')}"

    def __repr__(self) -> str:
        return f"<gitlab forge {self._name}>"

    def close(self) -> None:
        self._api.close()

    def open_pulls(self) -> list[PullRequest]:
        query = {"state": "opened", "per_page": 100}
        return _pulls(self._api.kind, self._api.get_all(f"{self._project}/merge_requests", query))

    def pull(self, number: int) -> PullRequest | None:
        return _one_pull(self._api, f"{self._project}/merge_requests/{int(number)}")

    def set_status(
        self, sha: str, state: str, context: str, description: str, url: str | None
    ) -> None:
        body = _status(sha, state, description, url)
        body.update(state=_GITLAB_STATES[state], name=context)
        path = f"{self._project}/statuses/{sha}"
        resp = self._api.call("POST", path, body=body, accept=(400,))
        # GitLab answers 400 to a status the commit already has: nothing to change
        if resp.status_code == 400 and "Cannot transition status" not in error_message(resp):
            raise ForgeRefused(self._api.line("POST", path, f"400: {error_message(resp)}"))

    def upsert_comment(self, number: int, marker: str, body: str) -> None:
        head, text = _marked(marker, body)
        notes = f"{self._project}/merge_requests/{int(number)}/notes"
        query = {"per_page": 100, "sort": "asc", "order_by": "created_at"}
        found = _ours(self._api.get_all(notes, query), head)
        if found is None:
            self._api.call("POST", notes, body={"body": text}, repeatable=False)
        elif found.get("body") != text:
            self._api.call("PUT", f"{notes}/{found['id']}", body={"body": text})

    def pulls_of(self, sha: str) -> list[int]:
        path = f"{self._project}/repository/commits/{_checked(sha)}/merge_requests"
        return _numbers(self._api.get_all(path, {"per_page": 100}), "iid")

    def can_write(self, user: str, user_id: int | None = None) -> bool:
        if user_id is None:
            users = self._api.json(self._api.call("GET", "/users", params={"username": user}))
            ids = (
                [u.get("id") for u in users if isinstance(u, dict)]
                if isinstance(users, list)
                else []
            )
            if not ids or not isinstance(ids[0], int):
                return False
            user_id = ids[0]
        # members/all: inherited from groups too
        path = f"{self._project}/members/all/{int(user_id)}"
        resp = self._api.call("GET", path, accept=(404,))
        if resp.status_code == 404:  # not a member
            return False
        found = self._api.json(resp)
        level = found.get("access_level") if isinstance(found, dict) else None
        named = found.get("username") if isinstance(found, dict) else None
        # an id from a webhook names the user who acted: the member must be that user
        return isinstance(level, int) and level >= _GITLAB_DEVELOPER and named in (None, user)


def _location(repo_url: str) -> tuple[str, str, list[str]]:
    """(scheme for the API, host[:port], path segments) of a clone URL; no credentials."""
    if "://" not in repo_url:  # scp-like: [user@]host:owner/repo.git
        found = re.match(r"^(?:[^@/]+@)?([^:/]+):(.+)$", repo_url.strip())
        if not found:
            raise ValueError("repository URL names no host: cannot find its forge")
        scheme, host, path = "https", found.group(1), found.group(2)
    else:
        parts = urlsplit(repo_url.strip())
        if not parts.hostname:
            raise ValueError(f"repository URL ({parts.scheme}://...) names no host")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        scheme = parts.scheme if parts.scheme in ("http", "https") else "https"
        if parts.port and scheme == parts.scheme:  # an SSH port is not the API's
            host = f"{host}:{parts.port}"
        path = parts.path
    segments = [s for s in path.strip("/").removesuffix(".git").split("/") if s]
    if len(segments) < 2:
        raise ValueError(f"repository URL on {host} names no owner/repository path")
    return scheme, host, segments


def _guess_kind(host: str) -> str:
    name = host.lower().split(":")[0]
    if name in ("github.com", "www.github.com"):
        return "github"
    for kind in ("gitlab", "gitea"):
        if kind in name:
            return kind
    raise ValueError(f"cannot tell which forge {host} runs: set the forge kind ({'|'.join(KINDS)})")


def forge_for(
    repo_url: str,
    token: str,
    api_url: str | None = None,
    kind: str | None = None,
    *,
    timeout: float = 10.0,
    max_wait: float = 60.0,
    retries: int = 3,
    backoff: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
) -> Forge:
    """The forge hosting ``repo_url``; ``api_url`` overrides the API base it guesses.

    ``kind`` is github, gitea or gitlab; without it the host decides (github.com,
    a host naming gitlab or gitea). ``max_wait`` bounds the seconds one call spends
    waiting on rate limits and retries. Raises ValueError for a URL or kind it
    cannot use.
    """
    if not token:
        raise ValueError("the forge token is empty")
    logs.register_secret(token)
    scheme, host, segments = _location(repo_url)
    kind = kind or _guess_kind(host)
    if kind not in KINDS:
        raise ValueError(f"forge kind {kind!r}: use one of {', '.join(KINDS)}")
    if api_url is not None:
        if urlsplit(api_url).scheme not in ("http", "https"):
            raise ValueError("the forge API URL must start with http:// or https://")
        base = api_url.rstrip("/")
        suffix = {"gitea": "/api/v1", "gitlab": "/api/v4"}.get(kind, "")
        base = base if base.endswith(suffix) else base + suffix
    elif kind == "github":
        github_com = host.lower() in ("github.com", "www.github.com")
        base = "https://api.github.com" if github_com else f"{scheme}://{host}/api/v3"
    elif kind == "gitea":  # Gitea may live below a path: https://host/git/owner/repo
        base = "/".join([f"{scheme}://{host}", *segments[:-2], "api/v1"])
    else:
        base = f"{scheme}://{host}/api/v4"
    headers = {
        "github": {
            "Authorization": f"Bearer {token}",
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28",
        },
        "gitea": {"Authorization": f"token {token}", "Accept": "application/json"},
        "gitlab": {"PRIVATE-TOKEN": token, "Accept": "application/json"},
    }[kind]
    api = ForgeHttp(
        kind,
        base,
        headers,
        timeout=timeout,
        max_wait=max_wait,
        retries=retries,
        backoff=backoff,
        sleep=sleep,
    )
    if kind == "gitlab":
        return _GitLabForge(api, "/".join(segments))
    page = {"per_page": 100} if kind == "github" else {"limit": 50}
    return _HubForge(api, segments[-2], segments[-1], page)
