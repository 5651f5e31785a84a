"""What a forge says about pull requests: webhook events, API objects and PR refs (no I/O).

GitHub and Gitea send ``pull_request`` events whose ``pull_request`` object has the
same shape as their REST API's; GitLab sends ``Merge Request Hook`` events whose
``object_attributes`` differ from its REST API's merge request. Each shape is a
pydantic model; all of them become one :class:`PullRequest`. A body that is not
what its event promises is a :class:`~gitops_sless.source.webhooks.PayloadError` naming
the field, never a crash.

Where the PR comes from matters to previews (see environments.py): ``same_repo`` is
True when its head is in the repository it targets (GitHub and Gitea
``head.repo.full_name == base.repo.full_name``, GitLab ``source_project_id ==
target_project_id``), False for a fork (or a fork since deleted), None when the
object does not say. An event also says who acted (``sender``) and which labels
it added, so that a maintainer's label can approve one commit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ..source.webhooks import FORGES, PayloadError

__all__ = [
    "PullRequest",
    "pull_from_api",
    "pull_number_from_ref",
    "pull_request_event",
]

_PULL_REF = re.compile(r"^refs/(?:pull|merge-requests)/([1-9][0-9]{0,9})/head$")

# actions after which what a preview shows may change; others (assigned, review_requested,
# approved, ...) are answered with None
_GITHUB_ACTIONS = {"opened", "reopened", "synchronize", "edited", "labeled", "unlabeled", "closed"}
_GITEA_ACTIONS = {
    "opened",
    "reopened",
    "synchronized",
    "edited",
    "label_updated",
    "label_cleared",
    "closed",
}
_GITLAB_ACTIONS = {"open", "reopen", "update", "close", "merge"}
# X-Gitea-Event is pull_request for every PR delivery; X-Gitea-Event-Type is finer
_PULL_EVENTS = {"pull_request", "pull_request_sync", "pull_request_label"}
_MERGE_EVENTS = {"merge_request", "merge request hook"}


@dataclass(frozen=True)
class PullRequest:
    """One pull (merge) request as the forge describes it."""

    number: int
    state: str  # "open" | "closed" (merged counts as closed)
    head_sha: str | None
    base: str | None  # base branch name
    title: str | None = None
    author: str | None = None
    head_branch: str | None = None
    labels: tuple[str, ...] = ()
    merged: bool = False
    same_repo: bool | None = None  # head in the base repository; None: not said
    sender: str | None = None  # who acted (events only)
    sender_id: int | None = None
    # labels this event added; None: the event does not say which (Gitea's label_updated)
    labels_added: tuple[str, ...] | None = ()


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


_M = TypeVar("_M", bound=_Model)


class _Login(_Model):
    login: str | None = None
    id: int | None = None


class _Repo(_Model):
    full_name: str | None = None


class _Ref(_Model):
    ref: str | None = None
    sha: str | None = None
    repo: _Repo | None = None


class _Label(_Model):
    name: str


class _Pull(_Model):
    """GitHub's and Gitea's pull request object (webhooks and REST API alike)."""

    number: int
    state: str
    title: str | None = None
    user: _Login | None = None
    head: _Ref | None = None
    base: _Ref | None = None
    labels: list[_Label] | None = None
    merged: bool | None = None
    merged_at: str | None = None

    def same_repo(self) -> bool | None:
        """A head repository that is null (a deleted fork) is not the base's."""
        base = self.base.repo.full_name if self.base and self.base.repo else None
        if base is None or self.head is None or "repo" not in self.head.model_fields_set:
            return None
        return self.head.repo is not None and self.head.repo.full_name == base

    def pull(self) -> PullRequest:
        merged = bool(self.merged or self.merged_at)
        return PullRequest(
            number=self.number,
            state="open" if self.state == "open" and not merged else "closed",
            head_sha=self.head.sha if self.head else None,
            base=self.base.ref if self.base else None,
            title=self.title,
            author=self.user.login if self.user else None,
            head_branch=self.head.ref if self.head else None,
            labels=tuple(label.name for label in self.labels or ()),
            merged=merged,
            same_repo=self.same_repo(),
        )


class _PullEvent(_Model):
    action: str
    pull_request: _Pull
    label: _Label | None = None  # GitHub's labeled/unlabeled: the label
    sender: _Login | None = None

    def pull(self) -> PullRequest:
        pull = self.pull_request.pull()
        if self.action == "labeled":
            added: tuple[str, ...] | None = (self.label.name,) if self.label else None
        elif self.action == "label_updated":  # Gitea sends the labels after, not the change
            added = None
        else:
            added = ()
        sender = self.sender or _Login()
        return replace(pull, sender=sender.login, sender_id=sender.id, labels_added=added)


class _Username(_Model):
    username: str | None = None
    id: int | None = None


class _Commit(_Model):
    id: str | None = None


class _GitLabLabel(_Model):
    title: str


class _MergeAttributes(_Model):
    iid: int
    action: str | None = None
    state: str
    title: str | None = None
    last_commit: _Commit | None = None
    source_branch: str | None = None
    target_branch: str | None = None
    labels: list[_GitLabLabel] | None = None
    source_project_id: int | None = None
    target_project_id: int | None = None


class _LabelChange(_Model):
    previous: list[_GitLabLabel] | None = None
    current: list[_GitLabLabel] | None = None


class _Changes(_Model):
    labels: _LabelChange | None = None


class _MergeEvent(_Model):
    user: _Username | None = None
    object_attributes: _MergeAttributes
    labels: list[_GitLabLabel] | None = None
    changes: _Changes | None = None

    def labels_added(self) -> tuple[str, ...]:
        change = self.changes.labels if self.changes else None
        if change is None:
            return ()
        before = {label.title for label in change.previous or ()}
        return tuple(label.title for label in change.current or () if label.title not in before)


class _MergeRequest(_Model):
    """A merge request from GitLab's REST API: labels are plain names there."""

    iid: int
    state: str
    sha: str | None = None
    title: str | None = None
    author: _Username | None = None
    source_branch: str | None = None
    target_branch: str | None = None
    labels: list[str] | None = None
    source_project_id: int | None = None
    target_project_id: int | None = None


def _same_project(source: int | None, target: int | None) -> bool | None:
    return None if source is None or target is None else source == target


def _gitlab_state(state: str) -> str:
    return "open" if state == "opened" else "closed"  # closed, merged, locked


def _json_type(value: object) -> str:
    return {"dict": "an object", "list": "an array", "str": "a string", "NoneType": "null"}.get(
        type(value).__name__, f"a {type(value).__name__}"
    )


def _reason(exc: ValidationError, what: str) -> str:
    first = exc.errors(include_url=False)[0]
    kind, where = first["type"], ".".join(str(part) for part in first["loc"])
    if kind == "json_invalid":
        return f"{what} is not valid JSON: {first.get('ctx', {}).get('error', '?')}"
    if kind == "model_type" and not where:
        return f"{what} must be a JSON object, not {_json_type(first['input'])}"
    if kind == "missing":
        return f"{what} has no {where!r} field"
    return f"{what} field {where!r}: {first['msg']} (got {_json_type(first['input'])})"


def _parse(model: type[_M], body: bytes, what: str) -> _M:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise PayloadError(_reason(exc, what)) from None


def pull_request_event(forge: str, event: str, payload: bytes) -> PullRequest | None:
    """The pull request a webhook delivery is about, or None when it changes nothing here.

    ``event`` is the forge's event header (``pull_request``, ``Merge Request Hook``) or
    its normalised name (``merge_request``). Raises PayloadError for a malformed body.
    """
    if forge not in FORGES:
        raise ValueError(f"unknown forge {forge!r}: use one of {', '.join(FORGES)}")
    event = event.strip().lower()
    if forge in ("github", "gitea"):
        if event not in _PULL_EVENTS:
            return None
        found = _parse(_PullEvent, payload, "pull request payload")
        actions = _GITHUB_ACTIONS if forge == "github" else _GITEA_ACTIONS
        return found.pull() if found.action in actions else None
    if event not in _MERGE_EVENTS:
        return None
    hook = _parse(_MergeEvent, payload, "merge request payload")
    attrs = hook.object_attributes
    if attrs.action not in _GITLAB_ACTIONS:
        return None
    labels = hook.labels if hook.labels is not None else attrs.labels
    return PullRequest(
        number=attrs.iid,
        state=_gitlab_state(attrs.state),
        head_sha=attrs.last_commit.id if attrs.last_commit else None,
        base=attrs.target_branch,
        title=attrs.title,
        author=hook.user.username if hook.user else None,
        head_branch=attrs.source_branch,
        labels=tuple(label.title for label in labels or ()),
        merged=attrs.state == "merged" or attrs.action == "merge",
        same_repo=_same_project(attrs.source_project_id, attrs.target_project_id),
        sender=hook.user.username if hook.user else None,
        sender_id=hook.user.id if hook.user else None,
        labels_added=hook.labels_added(),
    )


def pull_from_api(forge: str, data: object) -> PullRequest:
    """One item of the forge's list of pull (merge) requests; PayloadError if malformed."""
    try:
        if forge == "gitlab":
            mr = _MergeRequest.model_validate(data)
            return PullRequest(
                number=mr.iid,
                state=_gitlab_state(mr.state),
                head_sha=mr.sha,
                base=mr.target_branch,
                title=mr.title,
                author=mr.author.username if mr.author else None,
                head_branch=mr.source_branch,
                labels=tuple(mr.labels or ()),
                merged=mr.state == "merged",
                same_repo=_same_project(mr.source_project_id, mr.target_project_id),
            )
        if forge in ("github", "gitea"):
            return _Pull.model_validate(data).pull()
    except ValidationError as exc:
        raise PayloadError(_reason(exc, f"{forge} pull request")) from None
    raise ValueError(f"unknown forge {forge!r}: use one of {', '.join(FORGES)}")


def pull_number_from_ref(ref: str) -> int | None:
    """``refs/pull/7/head`` or ``refs/merge-requests/7/head`` -> 7; anything else -> None."""
    found = _PULL_REF.match(ref)
    return int(found.group(1)) if found else None
