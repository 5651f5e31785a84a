"""Every function's phase, derived each pass from what is true now; never remembered.

Pure, like the planner: it reads the desired state, the plan, what the last
deploy attempts said and what the backend sees running, and returns the
fields of each function's record. An error that no longer applies is gone
in the pass that fixes it. The order of the checks is the order of the
pipeline: a manifest must be valid, its build done, the jobs it waits for
run, its deploy succeeded, and only then does what runs say how it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..manifests.model import DesiredState, Function
from ..plan.backend import Health
from ..plan.planner import Plan

__all__ = ["Outcome", "Summary", "derive", "inputs", "summarize"]


@dataclass(frozen=True)
class Outcome:
    """What the last deploy attempt of a spec said, while it is not running."""

    spec_hash: str
    # Pending: waits for something outside git (a secret); Failed: it did not start;
    # Progressing: a rollout of it is under way; RolledBack: its rollout failed
    phase: str
    message: str
    attempts: int = 0
    retry_at: float | None = None


STARTING = "starting: not seen running yet"


def _deployed(fn: Function, health: Health | None, observed: bool) -> dict[str, Any]:
    """``observed``: the backend reports what runs, so no report yet means not running yet."""
    if not fn.enabled:
        return {"phase": "Disabled", "message": None, "next_retry": None}
    if health is None:
        if observed:
            return {"phase": "Pending", "message": STARTING, "next_retry": None}
        return {"phase": "Ready", "message": None, "next_retry": None}
    fields: dict[str, Any] = {
        "phase": health.phase,
        "message": health.message,
        "last_exit": health.last_exit,
        "restarts": health.restarts,
        "next_retry": None,
    }
    if health.revision:
        fields["revision"] = health.revision
    if health.build_tag:
        fields["build_tag"] = health.build_tag
    return fields


def _one(
    fn: Function,
    plan: Plan,
    outcome: Outcome | None,
    health: Health | None,
    hashes: Mapping[str, str],
    observed: bool,
) -> dict[str, Any]:
    name = fn.name
    if name in plan.failed:
        fields: dict[str, Any] = {"phase": "Failed", "message": plan.failed[name]}
        if name in plan.retry_at and outcome is not None:
            return {**fields, "restarts": outcome.attempts, "next_retry": plan.retry_at[name]}
        return {**fields, "next_retry": None}
    if name in plan.building:
        return {"phase": "Building", "message": None, "next_retry": None}
    if name in plan.waiting:
        return {"phase": "Pending", "message": plan.waiting[name], "next_retry": None}
    if outcome is not None and outcome.spec_hash == hashes.get(name):
        fields = {"phase": outcome.phase, "message": outcome.message}
        if outcome.phase == "Failed":
            fields["restarts"] = outcome.attempts
        return {**fields, "next_retry": outcome.retry_at}
    return _deployed(fn, health, observed)


def inputs(
    fn: Function,
    plan: Plan,
    outcomes: Mapping[str, Outcome],
    health: Mapping[str, Health],
    hashes: Mapping[str, str],
) -> tuple[Any, ...]:
    """Everything one function's fields are derived from: equal inputs, equal fields."""
    name = fn.name
    return (
        fn,
        plan.failed.get(name),
        plan.retry_at.get(name),
        plan.building.get(name),
        plan.waiting.get(name),
        outcomes.get(name),
        hashes.get(name),
        health.get(name),
        bool(health),
    )


def derive(
    desired: DesiredState,
    plan: Plan,
    outcomes: Mapping[str, Outcome],
    health: Mapping[str, Health],
    hashes: Mapping[str, str],
    urls: Mapping[str, str | None],
    only: Iterable[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """name -> the fields of its record that this pass decides (of the functions ``only``
    names, if given; invalid ones always).

    ``hashes``: the spec hash each function's deploy would have now, for the
    functions the plan got that far with.
    """
    out = {
        name: {
            "phase": "Invalid",
            "manifest": path,
            "message": str(desired.invalid[path]),
            "next_retry": None,
        }
        for name, path in desired.invalid_names.items()
    }
    names = desired.functions if only is None else only
    for name in names:
        fn = desired.functions[name]
        out[name] = {
            **_one(fn, plan, outcomes.get(name), health.get(name), hashes, bool(health)),
            "manifest": fn.manifest,
            "url": urls.get(name),
            "wanted_tag": fn.build_tag,  # what the repository asks for; build_tag is what runs
        }
    return out


@dataclass(frozen=True)
class Summary:
    """A pass's result, from the phases it left: Succeeded means everything serves its commit."""

    result: str  # Succeeded, Progressing, Invalid or Degraded
    error: str | None


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _busy(name: str, record: Mapping[str, Any]) -> str:
    why = _first_line(record["message"])
    return f"{name}: {record['phase'].lower()}" + (f" ({why})" if why else "")


def summarize(
    records: Mapping[str, Mapping[str, Any]],
    desired: DesiredState,
    failed_jobs: Mapping[str, str],
) -> Summary:
    # names only: each function and job says why in its own record
    # a rollout that rolled back is a failure of the commit, as a failed deploy is
    failed = sorted(n for n, r in records.items() if r["phase"] in ("Failed", "RolledBack"))
    failed += [f"job {n}" for n in sorted(failed_jobs)]
    invalid = [_first_line(str(e)) for e in desired.invalid.values()]
    if failed:
        return Summary(
            "Degraded", f"{len(failed)} failed: " + "; ".join([", ".join(failed), *invalid])
        )
    if invalid:
        return Summary("Invalid", "; ".join(invalid))
    busy = sorted(
        n for n, r in records.items() if r["phase"] in ("Building", "Pending", "Progressing")
    )
    if busy:
        waiting = [_busy(n, records[n]) for n in busy[:5]]
        more = f" and {len(busy) - 5} more" if len(busy) > 5 else ""
        return Summary("Progressing", "; ".join(waiting) + more)
    return Summary("Succeeded", None)
