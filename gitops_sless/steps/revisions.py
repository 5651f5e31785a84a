"""Revisions of one environment's functions: each deploy recorded as one, the newest kept
runnable beside what serves, and rollbacks to one of them, which pin the function.

A rollback sends all of a function's traffic to an earlier kept revision at once,
without a build, and **pins** the function there: the passes that follow leave it
alone (it differs from git on purpose, as Argo CD marks an application rolled
back) until a commit changes the function (its desired spec hash is no longer the
one the pin was taken at) or someone unpins it. Every rollback and unpin is a line
of the log, a row of the sync history and a count in ``/metrics``, each with who
asked.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from .. import logs
from ..errors import PermanentError
from ..metrics import METRICS
from ..plan.backend import Deployment
from ..plan.planner import Plan
from ..state import revisions, serving
from ..state.revisions import Revision
from .context import Context, log

__all__ = ["NoSuchRevision", "Revisions", "RollbackRefused"]


class NoSuchRevision(PermanentError):
    """The function, or the revision asked for, is not kept: nothing to switch to."""


class RollbackRefused(PermanentError):
    """The switch cannot be made as asked (nothing serves yet, no earlier revision)."""


class Revisions:
    def __init__(self, ctx: Context, keep: int = revisions.DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep-revisions must be 1 or more, not {keep}")
        self.ctx = ctx
        self.keep = keep

    # --- recorded as deployed ---------------------------------------------------------------

    def record(self, deployment: Deployment, commit: str | None) -> Revision:
        """The revision ``deployment`` is (numbered next if it is new)."""
        ctx = self.ctx
        fn = deployment.function
        row = ctx.store.add_revision(
            ctx.env,
            fn.name,
            deployment.spec_hash,
            serving.to_record(deployment),
            commit,
            ctx.backend.image(fn),
        )
        return revisions.from_rows([row])[0]

    def deployed(self, deployment: Deployment, commit: str | None, show: bool = True) -> Revision:
        """``deployment`` serves now: the revision it is, with the kept revisions brought
        up to date beside it. ``show``: its record says so here (False: the caller writes
        ``serving_revision`` and ``pinned`` with the rest of the record, in one write)."""
        revision = self.record(deployment, commit)
        if revision.number == 1:  # its first: nothing else is kept, or rolled out
            self.ctx.backend.keep_revisions(self.ctx.env, deployment.name, revision.kept(), [])
            if show:
                self._show(deployment.name, revision.label)
            return revision
        self.keep_runnable(deployment.name, deployment.spec_hash, show)
        return revision

    def by_hash(self, name: str, spec_hash: str) -> Revision | None:
        return next((r for r in self.of(name) if r.spec_hash == spec_hash), None)

    def of(self, name: str) -> list[Revision]:
        """``name``'s kept revisions, newest first."""
        return revisions.from_rows(self.ctx.store.revisions(self.ctx.env, name))

    def serving(self, name: str) -> Revision | None:
        """The revision that takes ``name``'s traffic now, if it is known."""
        current = self.ctx.backend.deployed(self.ctx.env).get(name)
        return next((r for r in self.of(name) if r.spec_hash == current), None)

    def keep_runnable(self, name: str, current: str | None = None, show: bool = True) -> None:
        """Collect what is past the newest ``keep``, and tell the backend what stays runnable
        beside the revision with spec hash ``current`` (by default what serves now)."""
        ctx = self.ctx
        if current is None:
            current = ctx.backend.deployed(ctx.env).get(name)
        rollout = ctx.store.rollout_of(ctx.env, name)
        candidate = rollout["candidate"] if rollout and rollout["phase"] == "Progressing" else None
        stay, gone = revisions.kept(self.of(name), self.keep, current, candidate)
        if gone:
            ctx.store.drop_revisions(ctx.env, name, [r.number for r in gone])
        now = next((r for r in stay if r.spec_hash == current), None)
        if now is None:  # nothing of it serves (its first deploy failed): no URLs yet
            return
        others = [r.kept() for r in stay if r is not now]
        ctx.backend.keep_revisions(ctx.env, name, now.kept(), others)
        if show:
            self._show(name, now.label)

    def _show(self, name: str, serving_now: str | None = None) -> None:
        """The function's record says which revision serves, and which it is pinned at."""
        pin = self.ctx.store.pin_of(self.ctx.env, name)
        fields = {"pinned": revisions.label(pin["number"]) if pin else None}
        if serving_now is not None:
            fields["serving_revision"] = serving_now
        self.ctx.records.update(name, **fields)

    def restored(self, starting: Mapping[str, str]) -> None:
        """At start-up, the kept revisions beside what serves: what runs (adopted), and
        ``starting`` (a function's name: the spec hash it is about to start with)."""
        running = {**self.ctx.backend.deployed(self.ctx.env), **starting}  # once, not per fn
        for row in self.ctx.store.serving(self.ctx.env):
            current = running.get(row["name"])
            if current is not None:
                self.keep_runnable(row["name"], current)

    # --- pinned ---------------------------------------------------------------------------

    def hold_pinned(self, planned: Plan) -> None:
        """Leave out of ``planned`` the deploys of pinned functions whose desired version is
        the one they were pinned at; a function whose desired version changed is unpinned
        (a commit changed it: it deploys as planned)."""
        ctx = self.ctx
        pins = ctx.store.pins(ctx.env)
        if not pins:
            return
        held = []
        for deployment in planned.applies:
            pin = pins.get(deployment.name)
            if pin is None:
                continue
            if pin["desired"] is None:  # pinned before any pass knew what git wants
                ctx.store.pin(
                    ctx.env, deployment.name, pin["number"], deployment.spec_hash, pin["by"]
                )
            if pin["desired"] in (None, deployment.spec_hash):
                held.append(deployment)
                continue
            ctx.store.unpin(ctx.env, deployment.name)
            self._show(deployment.name)
            self._said("unpinned", deployment.name, "a commit changed it", "git")
        planned.applies = [d for d in planned.applies if d not in held]
        planned.held.update((d.name, d.spec_hash) for d in held)

    def pin_key(self) -> tuple[tuple[str, int, str | None], ...]:
        """What a plan depends on of the pins (a plan made before an unpin is stale)."""
        pins = self.ctx.store.pins(self.ctx.env)
        return tuple(sorted((n, p["number"], p["desired"]) for n, p in pins.items()))

    # --- by hand ------------------------------------------------------------------------------

    def rollback(self, name: str, to: str | None, by: str) -> Revision:
        """All of ``name``'s traffic to revision ``to`` (``rN`` or an id; None: the newest
        kept before the one serving), at once; the function is pinned there."""
        ctx = self.ctx
        kept = self.of(name)
        now = self.serving(name)
        if not kept:
            raise NoSuchRevision(f"{ctx.env}/{name}: no revision is kept")
        if now is None:
            raise RollbackRefused(f"{ctx.env}/{name}: nothing of it serves yet")
        if to is None:
            earlier = [r for r in kept if r.number < now.number]
            if not earlier:
                raise RollbackRefused(f"{ctx.env}/{name}: no revision before {now.label}")
            target = earlier[0]
        else:
            found = revisions.find(kept, to)
            if found is None:
                labels = ", ".join(r.label for r in kept)
                raise NoSuchRevision(f"{ctx.env}/{name}: no revision {to} (kept: {labels})")
            target = found
        if target.spec_hash == now.spec_hash:
            raise RollbackRefused(f"{ctx.env}/{name}: {target.label} serves already")
        started = time.time()
        ctx.backend.switch_to(ctx.env, target.kept(), now.kept())
        rollout = ctx.store.rollouts(ctx.env).get(name)
        if rollout is not None and rollout["phase"] == "Progressing":  # it ends here
            stopped = f"stopped by a rollback to {target.label} (asked by {by})"
            ctx.store.set_rollout(ctx.env, name, phase="Withdrawn", message=stopped)
            ctx.outcomes.pop(name, None)
        deployment = target.deployment()
        ctx.store.set_serving(ctx.env, name, target.record, target.commit)
        ctx.store.pin(ctx.env, name, target.number, self._desired(name), by)
        ctx.records.update(
            name,
            build_tag=deployment.function.build_tag,
            revision=target.commit,
            spec={
                "hash": deployment.spec_hash,
                "replicas": deployment.function.replicas,
                "http": deployment.function.http,
            },
        )
        self.keep_runnable(name, target.spec_hash)
        said = f"{now.label} to {target.label}, pinned until a commit changes it or an unpin"
        self._said("rollback", name, said, by, started, target.commit)
        return target

    def unpin(self, name: str, by: str) -> bool:
        """Let the passes deploy ``name`` as the repository says again; False: not pinned."""
        pin = self.ctx.store.unpin(self.ctx.env, name)
        if pin is None:
            return False
        self._show(name)
        self._said("unpin", name, f"no longer held at r{pin['number']}", by)
        return True

    def pinned(self) -> dict[str, dict[str, object]]:
        """The pinned functions: name -> {revision, by, at}."""
        pins = self.ctx.store.pins(self.ctx.env)
        return {
            name: {"revision": revisions.label(p["number"]), "by": p["by"], "at": p["at"]}
            for name, p in pins.items()
        }

    def _desired(self, name: str) -> str | None:
        """The spec hash the repository asks for ``name`` as of the last pass (None: not
        known yet; the next pass takes it as the pin's)."""
        cached = self.ctx.deployments.get(name)
        return cached[2].spec_hash if cached is not None else None

    def _said(
        self,
        action: str,
        name: str,
        what: str,
        by: str,
        started: float | None = None,
        commit: str | None = None,
    ) -> None:
        ctx = self.ctx
        row = ctx.store.begin_sync(ctx.env, f"{action} by {by}", started or time.time())
        ctx.store.finish_sync(row, "Succeeded", commit)
        METRICS.revision_switches.inc(env=ctx.env, function=name, action=action, by=by)
        where = {"env": ctx.env, "function": name, "by": by}
        logs.event(log, f"function.{action}", f"{name}: {what} (asked by {by})", **where)
