"""Revisions: every distinct version of a function deployed in an environment.

A revision is a deployment (the function's code identity and its rendered
configuration: its spec hash) as it was first deployed in an environment. It has
an id made from that hash (short and stable: the same version deployed again is
the same revision) and a number per function and environment, ``r1``, ``r2``, …
in the order they were first deployed, as Knative numbers a Service's revisions.
The newest ``keep`` stay runnable (see ``kept``): a call to
``/fn/{env}/{name}@{revision}/`` reaches one, and a rollback switches to one
without a build.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..manifests.model import Rollout
from ..plan.backend import Deployment, KeptRevision
from . import serving

__all__ = [
    "DEFAULT_KEEP",
    "ID_LENGTH",
    "Revision",
    "find",
    "from_rows",
    "kept",
    "label",
    "revision_id",
]

DEFAULT_KEEP = 5  # serve --keep-revisions
ID_LENGTH = 10  # hex digits of the spec hash: unique among a function's revisions
_NUMBER = re.compile(r"r([1-9][0-9]{0,8})")


def revision_id(spec_hash: str) -> str:
    """The id of the revision that ``spec_hash`` is."""
    return spec_hash[:ID_LENGTH]


def label(number: int) -> str:
    return f"r{number}"


@dataclass(frozen=True)
class Revision:
    """One revision of one function in one environment, as the store keeps it."""

    env: str
    name: str
    number: int
    spec_hash: str
    commit: str | None
    build_tag: str
    image: str | None
    created: float
    deployed: float  # when it last started serving (the first time: ``created``)
    record: Mapping[str, Any]  # the serving record to start it again (state.serving)

    @property
    def id(self) -> str:
        return revision_id(self.spec_hash)

    @property
    def label(self) -> str:
        return label(self.number)

    def deployment(self) -> Deployment:
        """What to start to serve this revision again."""
        return serving.from_record(self.record)

    def rollout(self) -> Rollout | None:
        """Its function's ``rollout`` block (the record is not decoded whole for it)."""
        return serving.rollout_of(self.record)

    def kept(self) -> KeptRevision:
        """This revision as the backend keeps it runnable."""
        return KeptRevision(self.label, self.id, self.deployment())


def from_rows(rows: Iterable[Mapping[str, Any]]) -> list[Revision]:
    """Store rows (``Store.revisions``) as revisions, in the same order."""
    return [
        Revision(
            env=row["env"],
            name=row["name"],
            number=row["number"],
            spec_hash=row["spec_hash"],
            commit=row["commit_sha"],
            build_tag=row["build_tag"],
            image=row["image"],
            created=row["created"],
            deployed=row["deployed"],
            record=json.loads(row["deployment"])
            if isinstance(row["deployment"], str)
            else row["deployment"],
        )
        for row in rows
    ]


def find(revisions: Sequence[Revision], ref: str) -> Revision | None:
    """The revision ``ref`` names: ``rN``, or its id (or an unambiguous prefix of it, at
    least 6 digits, as git takes a short commit)."""
    match = _NUMBER.fullmatch(ref)
    if match is not None:
        number = int(match.group(1))
        return next((r for r in revisions if r.number == number), None)
    if len(ref) < 6 or not all(c in "0123456789abcdef" for c in ref):
        return None
    found = [r for r in revisions if r.id.startswith(ref) or r.spec_hash.startswith(ref)]
    return found[0] if len(found) == 1 else None


def kept(
    revisions: Sequence[Revision], keep: int, current: str | None, candidate: str | None = None
) -> tuple[list[Revision], list[Revision]]:
    """(kept, collected): the newest ``keep`` revisions by number stay, and whatever its
    number the one that serves (spec hash ``current``: a function pinned at an old one)
    and a rollout's ``candidate``; the others are collected. ``revisions`` newest first."""
    newest = sorted(revisions, key=lambda r: r.number, reverse=True)
    must = [r for r in newest if r.spec_hash in (current, candidate)]
    rest = [r for r in newest if r not in must]
    stay = must + rest[: max(keep - len(must), 0)]
    return sorted(stay, key=lambda r: r.number, reverse=True), [r for r in rest if r not in stay]
