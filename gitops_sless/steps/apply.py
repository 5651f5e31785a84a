"""Apply: start or replace what the plan deploys, side by side; a deploy that fails is
tried again later and later (CrashLoopBackOff), one waiting for a secret on every pass."""

from __future__ import annotations

import logging
from typing import Any

from .. import backoff, logs
from ..errors import SlessError
from ..plan.backend import Deployment, SecretUnavailable
from ..plan.planner import Plan
from ..state import serving
from ..state.phases import Outcome
from .context import Context, PassState, log, short
from .revisions import Revisions
from .rollouts import Rollouts

__all__ = ["Apply"]


class Apply:
    def __init__(
        self, ctx: Context, revisions: Revisions | None = None, rollouts: Rollouts | None = None
    ) -> None:
        self.ctx = ctx
        self.revisions = revisions or Revisions(ctx)
        self.rollouts = rollouts or Rollouts(ctx, self.revisions)

    def run(self, planned: Plan, revision: str, current: PassState) -> None:
        ctx = self.ctx
        running = set(ctx.backend.deployed(ctx.env)) if planned.applies else set()
        applied = ctx.run_all(lambda d: self._one(d, revision, d.name in running), planned.applies)
        current.applies += sum(1 for a in applied if a is True)
        current.failures += sum(1 for a in applied if a is False)
        if any(a is not None for a in applied):
            ctx.begin_row(current)

    def _one(self, deployment: Deployment, revision: str, replacing: bool) -> bool | None:
        """Start or replace one function: True if it did, False if it failed, None if it
        waits for a secret or the server stops."""
        ctx = self.ctx
        fn = deployment.function
        where = {"env": ctx.env, "function": fn.name, "revision": short(revision)}
        if self.rollouts.wants(deployment):  # step by step, beside what serves
            return self.rollouts.start(deployment, revision)
        try:
            ctx.backend.apply(deployment, revision)
        except SecretUnavailable as exc:
            # tried again on every pass: the secret may appear without a commit
            before = ctx.outcomes.get(fn.name)
            ctx.outcomes[fn.name] = Outcome(deployment.spec_hash, "Pending", str(exc))
            level = logging.DEBUG if before and before.message == str(exc) else logging.WARNING
            logs.event(log, "deploy.waiting", str(exc), level=level, **where)
            return None
        except SlessError as exc:
            if ctx.stopping.is_set():  # refused by the shutdown, not by the function
                return None
            self._back_off(deployment, str(exc), where)
            return False
        ctx.outcomes.pop(fn.name, None)
        ctx.store.set_serving(ctx.env, fn.name, serving.to_record(deployment), revision)
        ctx.serving.add(fn.name)
        number = self.revisions.deployed(deployment, revision, show=False).label
        ctx.records.update(
            fn.name,
            build_tag=fn.build_tag,
            revision=revision,
            serving_revision=number,
            pinned=None,  # a deploy is never held by a pin: none holds it now
            restarts=0,
            last_exit=None,
            next_retry=None,
            spec={"hash": deployment.spec_hash, "replicas": fn.replicas, "http": fn.http},
        )
        what = "replaced" if replacing else "deployed"
        state = "" if fn.enabled else ", disabled"
        said = f"{fn.name} {what}: {number} ({fn.build_tag}{state})"
        logs.event(log, f"function.{what}", said, revisionNumber=number, **where)
        return True

    def _back_off(self, deployment: Deployment, message: str, where: dict[str, Any]) -> None:
        ctx = self.ctx
        before = ctx.outcomes.get(deployment.name)
        same = before is not None and before.spec_hash == deployment.spec_hash
        attempts = before.attempts + 1 if same and before else 1
        wait = backoff.delay(attempts)
        ctx.outcomes[deployment.name] = Outcome(
            deployment.spec_hash, "Failed", message, attempts, ctx.clock() + wait
        )
        logs.event(
            log,
            "deploy.failed",
            f"{message} (attempt {attempts}; next try in {wait:g}s)",
            level=logging.ERROR,
            attempt=attempts,
            retryInSec=wait,
            **where,
        )
