"""The API of revisions: list a function's, roll it back to one, unpin it.

Reads need a read token, like the rest of the status; a rollback or an unpin needs
the API token. Each route answers under ``/api/v1/`` like the rest of the API, and
under ``/api/`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, HTTPException, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field

from ..errors import SlessError
from ..reconciler import Reconciler
from ..state import revisions as revisions_mod
from ..state.revisions import Revision
from ..state.routes import RouteTable
from ..state.store import Store
from ..steps import NoSuchRevision, RollbackRefused
from ..timestamps import rfc3339
from . import replies
from .models import ApiModel, Timestamp

__all__ = ["Pin", "RevisionList", "RevisionView", "RolloutView", "revision_list", "router"]

_bearer = HTTPBearer(auto_error=False)
_READ = [Security(_bearer)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
BASE = "/environments/{env}/functions/{name}"


class RevisionView(ApiModel):
    revision: str = Field(description="its number in this environment: r1, r2, ...")
    id: str = Field(description="from its code and configuration: the same version, the same id")
    commit: str | None = Field(description="the commit it was deployed from")
    build_tag: str
    image: str | None = Field(description="the image it runs, by digest (Kubernetes)")
    created: Timestamp = Field(description="when it was first deployed here")
    deployed: Timestamp = Field(description="when it last started taking the traffic")
    traffic: int = Field(description="percent of the function's calls it takes")
    state: Literal["serving", "candidate", "kept"] = Field(
        description="serving: takes the traffic (during a rollout, the share the candidate "
        "does not); candidate: a rollout's new revision, taking its step's share; kept: "
        "runnable, reached by its own URL"
    )
    replicas: int = Field(description="replicas running now (a kept one starts on a call)")
    url: str = Field(description="its own URL: reaches it whatever the traffic split")


class Pin(ApiModel):
    revision: str = Field(description="the revision it is held at")
    by: str = Field(description="who asked")
    at: Timestamp


class RolloutView(ApiModel):
    phase: Literal["Progressing", "Promoted", "RolledBack", "Withdrawn"] = Field(
        description="Withdrawn: stopped without a verdict (a revert, a rollback by hand)"
    )
    candidate: str | None = Field(description="the new revision")
    stable: str | None = Field(description="the revision that served when it began")
    step: int = Field(description="1 for the first step; the last is 100 %")
    steps: int
    traffic: int = Field(description="percent of the calls the candidate takes now")
    message: str | None = Field(description="where it is, with the counts that decide it")
    updated: Timestamp


class RevisionList(ApiModel):
    env: str
    function: str
    serving: str | None = Field(description="the revision taking the traffic")
    pinned: Pin | None = Field(
        description="held at an earlier revision by a rollback, until a commit changes the "
        "function or an unpin"
    )
    rollout: RolloutView | None = Field(
        description="the latest rollout of the function (none: never rolled out)"
    )
    revisions: list[RevisionView] = Field(description="the kept revisions, newest first")


class RollbackRequest(ApiModel):
    to: str | None = Field(
        None, description="rN or a revision id; none: the newest kept before the one serving"
    )


def revision_list(
    store: Store, routes: RouteTable, env: str, name: str, fn_url: str
) -> RevisionList | None:
    """``name``'s kept revisions as the API shows them; None: it has none."""
    kept = revisions_mod.from_rows(store.revisions(env, name))
    if not kept:
        return None
    row = next((r for r in store.serving(env) if r["name"] == name), None)
    current = row["deployment"].get("specHash") if row else None
    pin = store.pins(env).get(name)
    now = next((r for r in kept if r.spec_hash == current), None)
    rollout = rollout_view(store.rollouts(env).get(name), kept)
    share = rollout.traffic if rollout and rollout.phase == "Progressing" else 0
    candidate = rollout.candidate if share else None
    return RevisionList(
        env=env,
        function=name,
        serving=now.label if now else None,
        pinned=_pin(pin),
        rollout=rollout,
        revisions=[_view(routes, fn_url, r, r is now, r.label == candidate, share) for r in kept],
    )


def _view(
    routes: RouteTable,
    fn_url: str,
    revision: Revision,
    serving: bool,
    candidate: bool,
    share: int,
) -> RevisionView:
    env, name = revision.env, revision.name
    route = routes.get(env, name) if serving else routes.revision(env, f"{name}@{revision.id}")
    traffic = 100 - share if serving else (share if candidate else 0)
    state = "serving" if serving else ("candidate" if candidate else "kept")
    return RevisionView(
        revision=revision.label,
        id=revision.id,
        commit=revision.commit,
        build_tag=revision.build_tag,
        image=revision.image,
        created=rfc3339(revision.created),
        deployed=rfc3339(revision.deployed),
        traffic=traffic,
        state=state,
        replicas=route.serving if route is not None else 0,
        url=f"{fn_url}/fn/{env}/{name}@{revision.label}/",
    )


def _pin(row: dict[str, Any] | None) -> Pin | None:
    if row is None:
        return None
    return Pin(revision=revisions_mod.label(row["number"]), by=row["by"], at=rfc3339(row["at"]))


def rollout_view(row: dict[str, Any] | None, kept: list[Revision]) -> RolloutView | None:
    if row is None:
        return None
    by_hash = {r.spec_hash: r for r in kept}
    candidate, stable = by_hash.get(row["candidate"]), by_hash.get(row["stable"])
    policy = candidate.rollout() if candidate is not None else None
    steps = list(policy.steps) if policy is not None else []
    step = min(row["step"], max(len(steps) - 1, 0))
    share = steps[step] if steps and row["phase"] == "Progressing" else 0
    if row["phase"] == "Promoted":
        share = 100
    return RolloutView(
        phase=row["phase"],
        candidate=candidate.label if candidate else None,
        stable=stable.label if stable else None,
        step=len(steps) + 1 if row["phase"] == "Promoted" else step + 1,
        steps=len(steps) + 1,
        traffic=share,
        message=row["message"],
        updated=rfc3339(row["updated"]),
    )


def router(
    reconciler: Reconciler,
    store: Store,
    routes: RouteTable,
    authorize: Callable[[HTTPAuthorizationCredentials | None], None],
    fn_url: str,
) -> APIRouter:
    """The routes; ``authorize(credentials)`` raises unless they may write."""
    api = APIRouter(tags=["revisions"])

    def listing(env: str, name: str) -> RevisionList:
        found = revision_list(store, routes, env, name, fn_url)
        if found is None:
            raise HTTPException(404, f"no revision of {name!r} in environment {env!r}")
        return found

    def tracked(env: str) -> None:
        if env != reconciler.env:
            raise HTTPException(
                409,
                f"{env!r} is not the tracked branch's environment ({reconciler.env!r}): "
                "a preview follows its pull request and is never rolled back",
            )

    @api.get(f"/api/v1{BASE}/revisions", dependencies=_READ, responses=replies.errors(401, 404))
    @api.get(f"/api{BASE}/revisions", include_in_schema=False)
    def revisions(env: str, name: str) -> RevisionList:
        """The function's kept revisions, newest first, and which one takes the traffic."""
        return listing(env, name)

    @api.post(f"/api/v1{BASE}/rollback", responses=replies.errors(401, 403, 404, 409, 503))
    @api.post(f"/api{BASE}/rollback", include_in_schema=False)
    def rollback(
        env: str,
        name: str,
        credentials: Credentials,
        request: Annotated[RollbackRequest | None, Body()] = None,
    ) -> RevisionList:
        """All of the function's traffic to an earlier kept revision at once, without a
        build; the function is pinned there until a commit changes it or an unpin."""
        authorize(credentials)
        tracked(env)
        to = request.to if request is not None else None
        try:
            reconciler.between_passes(lambda: reconciler.revisions.rollback(name, to, "api"))
        except NoSuchRevision as exc:
            raise HTTPException(404, str(exc)) from exc
        except RollbackRefused as exc:
            raise HTTPException(409, str(exc)) from exc
        except SlessError as exc:  # the revision could not start (a secret, a crash)
            raise HTTPException(503, f"{env}/{name}: not switched: {exc}") from exc
        return listing(env, name)

    @api.post(f"/api/v1{BASE}/unpin", responses=replies.errors(401, 403, 404, 409))
    @api.post(f"/api{BASE}/unpin", include_in_schema=False)
    def unpin(env: str, name: str, credentials: Credentials) -> RevisionList:
        """Let the passes deploy the function as the repository says again (at once: a
        pass is asked for)."""
        authorize(credentials)
        tracked(env)
        if not reconciler.between_passes(lambda: reconciler.revisions.unpin(name, "api")):
            raise HTTPException(409, f"{env}/{name} is not pinned")
        reconciler.request_sync("unpin")
        return listing(env, name)

    return api
