"""Who may run a preview: the approval label and the forge's word on who added it, the
filter's label, and whether a webhook that opens a preview agrees with the forge."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from .. import logs
from ..errors import SlessError
from .forge import ForgeUnavailable
from .pulls import PullRequest
from .states import CLOSED, env_name
from .trust import Decision, Gate, adds_label, label_commit

if TYPE_CHECKING:  # the previews' own types, which use this module
    from ..state.store import Store
    from .environments import Forge, PreviewConfig

__all__ = ["Approvals"]

log = logging.getLogger("gitops_sless.previews.environments")  # the previews' one logger


class Approvals:
    def __init__(self, store: Store, forge: Forge | None, config: PreviewConfig) -> None:
        self.store = store
        self.forge = forge
        self.config = config
        self.gate = Gate(config.trust, config.approve_label, config.label, forge is not None)
        # why the last label did not approve: number -> (the head it was added at, why)
        self._refused: dict[int, tuple[str, str]] = {}

    def unconfirmed(self, pr: PullRequest) -> str | None:
        """Why a webhook that would open or reopen ``pr``'s preview is to be ignored, or None.

        With a forge token, the forge's API must agree (open, at the head the event
        names) before anything is built: a replayed ``opened`` of a closed PR, or of an
        older head, opens nothing. A forge that cannot answer now opens nothing either:
        its list of open PRs, read later, does.
        """
        if self.forge is None or pr.state != "open":
            return None
        row = self.store.preview(pr.number)
        if row is not None and row["state"] not in (CLOSED, "TearingDown"):
            return None  # open already: this event opens nothing
        try:
            now = self.forge.pull(pr.number)
        except SlessError as exc:
            return f"pull request {pr.number} could not be confirmed with the forge: {exc}"
        if now is None or now.state != "open":
            state = "unknown" if now is None else now.state
            return f"the forge says pull request {pr.number} is {state}"
        if pr.head_sha and now.head_sha != pr.head_sha:
            return (
                f"the forge says pull request {pr.number} is at {(now.head_sha or '?')[:12]}, "
                f"not {pr.head_sha[:12]}"
            )
        return None

    def approves(self, row: dict[str, Any] | None, pr: PullRequest) -> bool:
        """An event that adds the approval label, by someone, at a known head."""
        before = (row or {}).get("labels") or ()
        return (
            self.config.trust == "approved"
            and bool(pr.sender and pr.head_sha)
            and adds_label(self.config.approve_label, before, pr.labels, pr.labels_added)
        )

    def labelled(
        self,
        row: dict[str, Any] | None,
        labels: tuple[str, ...],
        added: tuple[str, ...] | None,
        head: str | None,
    ) -> dict[str, Any]:
        """The commit the filter's label selects after this observation (a field to set)."""
        if self.config.label is None:
            return {}
        before = (row or {}).get("labels") or ()
        previous = (row or {}).get("label_sha")
        return {"label_sha": label_commit(self.config.label, before, labels, added, head, previous)}

    def check_all(self) -> None:
        """Ask the forge whether each user who added the approval label may write."""
        for row in self.store.previews():
            if row.get("approval_request") and row["state"] != CLOSED:
                self._check(row["number"], json.loads(row["approval_request"]))

    def _check(self, number: int, request: dict[str, Any]) -> None:
        user, sha, env = request["user"], request["sha"], env_name(number)
        if self.forge is None or self.config.trust != "approved":
            self.store.set_preview(number, approval_request=None)
            return
        try:
            allowed = self.forge.can_write(user, request.get("id"))
        except ForgeUnavailable as exc:  # asked again next pass
            logs.event(log, "forge.unavailable", str(exc), level=logging.WARNING, env=env)
            return
        except SlessError as exc:
            allowed, why = False, f"the forge would not say whether {user} may write: {exc}"
        else:
            why = (
                f'the label "{self.config.approve_label}" added by {user} approves nothing: '
                f"{user} has no write access"
            )
        self.store.set_preview(number, approval_request=None)
        if allowed:
            self._refused.pop(number, None)
            self.store.set_preview(number, approved=sha, approved_by=user)
            logs.event(log, "preview.approved", f"commit {sha[:12]} by {user}", env=env)
            return
        self._refused[number] = (sha, why)
        logs.event(log, "preview.not_approved", why, level=logging.WARNING, env=env)

    def why(self, number: int, head: str, decision: Decision) -> str:
        """The decision's reason, and why the last label at ``head`` approved nothing."""
        sha, refused = self._refused.get(number, ("", ""))
        return f"{decision.reason} ({refused})" if sha == head else str(decision.reason)

    def awaits(self, number: int) -> bool:
        """A fork a maintainer can approve: its PR hears that it waits (no other PR does)."""
        row = self.store.preview(number) or {}
        return self.gate.trust == "approved" and self.gate.can_approve and row.get("same_repo") == 0

    def trusted(self, number: int) -> bool:
        """Whether the PR's builds may use trusted credentials: a same-repo PR, unless the
        operator trusts every PR (then none is told apart, so every one builds apart)."""
        row = self.store.preview(number) or {}
        return self.gate.trust != "all" and row.get("same_repo") == 1
