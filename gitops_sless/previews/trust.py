"""Which commit of a pull request a preview may run: the trust level, approvals, the label.

A preview runs the PR's code with the previews' secrets and the reconciler's build
credentials, so whose code it runs is chosen, not assumed (``--preview-trust``):

- ``same-repo``: PRs whose head is in the repository itself (its author could push
  to it anyway). Where a PR comes from is known only from a webhook or the forge's
  API; a PR seen only as a ref waits (:data:`ORIGIN_UNKNOWN`).
- ``approved``: forks too, one commit at a time: a user with write access adds the
  approval label, and the head commit at that moment is approved. A new commit
  needs a new approval; meanwhile the approved commit keeps serving.
- ``all``: every PR (a private repository whose contributors are all trusted).

``--preview-filter label=NAME`` is checked per commit the same way: the label
selects the commit it was added at, so a push after it is not previewed until the
label is added again. Everything here is pure: rows in, a :class:`Decision` out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ORIGIN_UNKNOWN",
    "TRUST_LEVELS",
    "Decision",
    "Gate",
    "adds_label",
    "decide",
    "label_commit",
]

TRUST_LEVELS = ("same-repo", "approved", "all")
ORIGIN_UNKNOWN = "origin unknown: configure webhooks or SLESS_FORGE_TOKEN, or --preview-trust all"


@dataclass(frozen=True)
class Gate:
    """The settings a commit is checked against."""

    trust: str = "same-repo"
    approve_label: str = "preview"
    label: str | None = None  # --preview-filter label=NAME
    can_approve: bool = False  # a forge token: who added a label can be checked

    def __post_init__(self) -> None:
        if self.trust not in TRUST_LEVELS:
            raise ValueError(f"preview trust {self.trust!r}: use one of {', '.join(TRUST_LEVELS)}")


@dataclass(frozen=True)
class Decision:
    """What a preview may serve: ``commit`` (None: nothing, it waits) and why the head is not
    served when it is not (``reason``)."""

    commit: str | None
    reason: str | None = None

    @property
    def pinned(self) -> bool:
        """An older commit serves while the head waits."""
        return self.commit is not None and self.reason is not None


def _short(commit: str) -> str:
    return commit[:12]


def _untrusted(commit: str, row: Mapping[str, Any], gate: Gate) -> str | None:
    """Why ``commit`` may not run as far as its origin goes, or None."""
    if gate.trust == "all" or row.get("same_repo") == 1:
        return None
    if row.get("same_repo") is None:
        return ORIGIN_UNKNOWN
    if gate.trust == "same-repo":
        return (
            "from a fork: --preview-trust same-repo previews only pull requests from this "
            "repository (--preview-trust approved lets a user with write access approve "
            "each commit)"
        )
    if not gate.can_approve:
        return (
            "from a fork: approving needs SLESS_FORGE_TOKEN (to check who added the label), "
            "so forks wait as with --preview-trust same-repo"
        )
    if row.get("approved") == commit:
        return None
    return (
        f'from a fork: waits for a user with write access to add the label "{gate.approve_label}"'
        f" at commit {_short(commit)}"
    )


def _unlabelled(commit: str, row: Mapping[str, Any], gate: Gate) -> str | None:
    """Why the label filter does not select ``commit``, or None."""
    if gate.label is None or row.get("label_sha") == commit:
        return None
    where = f"--preview-filter label={gate.label}: "
    if row.get("forge_open") is None:  # no webhook or forge spoke of it: labels unknown
        return where + "labels unknown (the pull request is seen only as a ref)"
    if gate.label not in (row.get("labels") or ()):
        return where + f'the pull request has no label "{gate.label}"'
    return where + f"added before commit {_short(commit)}: add it again to preview this commit"


def _blocked(commit: str, row: Mapping[str, Any], gate: Gate) -> str | None:
    return _untrusted(commit, row, gate) or _unlabelled(commit, row, gate)


def decide(row: Mapping[str, Any], head: str, gate: Gate) -> Decision:
    """The commit of the PR in ``row`` a preview may run now: its head, else the commit last
    approved or labelled (it keeps serving), else none."""
    why = _blocked(head, row, gate)
    if why is None:
        return Decision(head)
    for older in (row.get("approved"), row.get("label_sha")):
        if older and older != head and _blocked(older, row, gate) is None:
            return Decision(
                older, f"serving {_short(older)} while head {_short(head)} waits: {why}"
            )
    return Decision(None, why)


def adds_label(
    label: str | None,
    before: Sequence[str],
    after: Sequence[str],
    added: Sequence[str] | None,
) -> bool:
    """Whether an observation adds ``label``: named by the event (``added``), else seen
    absent ``before`` and present ``after`` (an event or a list that does not say which)."""
    if label is None or label not in after:
        return False
    if added is not None:
        return label in added
    return label not in before


def label_commit(
    label: str | None,
    before: Sequence[str],
    after: Sequence[str],
    added: Sequence[str] | None,
    head: str | None,
    previous: str | None,
) -> str | None:
    """The commit ``label`` selects once labels go from ``before`` to ``after`` at ``head``:
    the head when the label is added (or first seen), the one it had while it stays, none
    once it is gone."""
    if label is None or label not in after:
        return None
    fresh = label not in before or (added is not None and label in added)
    return (head or previous) if fresh else previous
