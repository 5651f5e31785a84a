"""Progressive rollouts: a change of a function with a ``rollout`` block reaches its
callers step by step, judged by the new revision's own answers (Flagger's and Argo
Rollouts' canary, without a controller of its own).

The new revision (the candidate) starts beside the one serving (the stable) and takes
each step's share of the calls (the proxy splits: ``state.routes.Canary``). A pass
looks at every rollout under way: once the step's ``interval`` has passed and the
candidate answered at least ``minRequests`` calls in it, the step's error rate (5xx
and timeouts, from the proxy's counts of the candidate's calls) decides: at most
``maxErrorRate``, the next step, and after the last one the candidate takes every call
(promoted: the stable revision is kept, at zero after its idle time); over it, at any
time once ``minRequests`` is reached, or a candidate whose replicas keep ending, the
rollout stops (rolled back: every call to the stable revision, phase ``RolledBack``
with the numbers, until a commit changes the function again).

What a rollout is at lives in the status store (``rollouts``): a restart resumes it at
its step, counting the step's calls from the restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import logs
from ..errors import SlessError
from ..manifests.model import Rollout, is_preview
from ..metrics import METRICS
from ..plan.backend import Deployment
from ..plan.planner import Plan
from ..state import serving
from ..state.phases import Outcome
from ..state.revisions import Revision
from .context import Context, log
from .revisions import Revisions

__all__ = ["Rollouts"]

TICK_SEC = 1.0  # while a rollout is under way, a pass looks at it this often


class Rollouts:
    def __init__(
        self, ctx: Context, revisions: Revisions, ask_pass: Callable[[], Any] | None = None
    ) -> None:
        self.ctx = ctx
        self.revisions = revisions
        self._ask_pass = ask_pass
        # the candidate's counts when its step began (calls, failures), by function; kept in
        # memory (the proxy's counts are this process's): after a restart, from then
        self._base: dict[str, tuple[float, float]] = {}
        self._timer: threading.Timer | None = None

    # --- what the pass does --------------------------------------------------------------

    def wants(self, deployment: Deployment) -> bool:
        """Whether ``deployment`` reaches its callers by a rollout rather than at once: it
        has a ``rollout`` block and calls to judge it by (an http trigger, enabled),
        outside a preview, and another revision serves now."""
        ctx = self.ctx
        fn = deployment.function
        if fn.rollout is None or is_preview(ctx.env):
            return False
        if not (fn.http and fn.enabled):  # no calls to judge it by: at once
            return False
        if not ctx.backend.rollouts:
            return False
        current = ctx.backend.deployed(ctx.env).get(deployment.name)
        return current is not None and current != deployment.spec_hash

    def hold(self, planned: Plan) -> None:
        """Leave out of ``planned`` the deploys a rollout has taken on (under way, or rolled
        back: the same version is not tried again until a commit changes it)."""
        rows = self.ctx.store.rollouts(self.ctx.env)
        if not rows:
            return
        taken = {
            (name, row["candidate"])
            for name, row in rows.items()
            if row["phase"] in ("Progressing", "RolledBack")
        }
        held = [d for d in planned.applies if (d.name, d.spec_hash) in taken]
        planned.applies = [d for d in planned.applies if (d.name, d.spec_hash) not in taken]
        planned.held.update((d.name, d.spec_hash) for d in held)

    def start(self, deployment: Deployment, commit: str | None) -> bool:
        """Start the rollout of ``deployment`` (replacing one under way); False when its
        candidate could not start (rolled back at once)."""
        ctx = self.ctx
        name = deployment.name
        policy = deployment.function.rollout or Rollout()
        stable = self.revisions.serving(name)
        candidate = self.revisions.record(deployment, commit)
        if stable is None:  # what serves was never recorded (an old state folder): at once
            stable = self.revisions.record(self._running(name), None)
        ctx.store.set_rollout(
            ctx.env,
            name,
            candidate=candidate.spec_hash,
            stable=stable.spec_hash,
            phase="Progressing",
            step=0,
            step_started=time.time(),
            message=None,
        )
        try:
            ctx.backend.canary(ctx.env, name, candidate.kept(), policy.steps[0])
        except SlessError as exc:
            self._roll_back(name, candidate, stable, f"{candidate.label} did not start: {exc}")
            return False
        self._base[name] = self._counts(name, candidate)
        said = (
            f"{candidate.label} takes {policy.steps[0]}% of the calls "
            f"(step 1 of {len(policy.steps) + 1}), {stable.label} the rest"
        )
        self._progress(name, candidate, said)
        logs.event(log, "rollout.started", f"{name}: {said}", env=ctx.env, function=name)
        self.revisions.keep_runnable(name)  # the candidate's own URL
        self._tick_later()
        return True

    def advance(self) -> None:
        """Every rollout under way: a verdict where one is due."""
        ctx = self.ctx
        under_way = False
        for name, row in ctx.store.rollouts(ctx.env).items():
            if row["phase"] != "Progressing":
                continue
            candidate = self.revisions.by_hash(name, row["candidate"])
            stable = self.revisions.by_hash(name, row["stable"])
            if candidate is None or stable is None:  # collected meanwhile: nothing to judge
                ctx.store.set_rollout(ctx.env, name, phase="RolledBack", message="forgotten")
                continue
            wanted = ctx.deployments.get(name)
            if wanted is not None and wanted[2].spec_hash == stable.spec_hash:
                # a commit asks for what serves again (a revert): nothing to roll out
                why = f"{candidate.label} withdrawn: git asks for {stable.label} again"
                self._roll_back(name, candidate, stable, why)
                continue
            under_way = self._judge(name, row, candidate, stable) or under_way
        if under_way:
            self._tick_later()

    def restored(self) -> None:
        """At start-up: every rollout under way runs again at its step (its candidate beside
        the stable revision), and the outcome of every other is shown again."""
        ctx = self.ctx
        for name, row in ctx.store.rollouts(ctx.env).items():
            candidate = self.revisions.by_hash(name, row["candidate"])
            if candidate is None:
                continue
            if row["phase"] == "RolledBack":
                ctx.outcomes[name] = Outcome(candidate.spec_hash, "RolledBack", row["message"])
            if row["phase"] != "Progressing":
                continue
            policy = candidate.deployment().function.rollout or Rollout()
            step = min(row["step"], len(policy.steps) - 1)
            try:
                ctx.backend.canary(ctx.env, name, candidate.kept(), policy.steps[step])
            except SlessError as exc:
                stable = self.revisions.by_hash(name, row["stable"])
                if stable is not None:
                    why = f"{candidate.label} did not start again: {exc}"
                    self._roll_back(name, candidate, stable, why)
                continue
            # the step's calls are counted from now: the proxy's counts are this process's
            ctx.store.set_rollout(ctx.env, name, step_started=time.time())
            self._base[name] = self._counts(name, candidate)
            ctx.outcomes[name] = Outcome(candidate.spec_hash, "Progressing", row["message"] or "")
            self.revisions.keep_runnable(name)
            self._tick_later()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    # --- a verdict --------------------------------------------------------------------------

    def _judge(self, name: str, row: dict[str, Any], candidate: Revision, stable: Revision) -> bool:
        """One rollout's step; True while it goes on."""
        ctx = self.ctx
        policy = candidate.deployment().function.rollout or Rollout()
        steps = policy.steps
        step = min(row["step"], len(steps) - 1)
        share = steps[step]
        where = f"step {step + 1} of {len(steps) + 1} ({share}%)"
        broken = ctx.backend.canary_failure(ctx.env, name)
        if broken is not None:
            self._roll_back(name, candidate, stable, f"{candidate.label} at {where}: {broken}")
            return False
        calls, failures = self._since_step(name, candidate)
        rate = failures / calls if calls else 0.0
        limit = policy.max_error_rate
        counts = f"{failures:g} of {calls:g} calls failed ({rate:.1%}, at most {limit:.1%})"
        if calls and calls >= policy.min_requests and rate > policy.max_error_rate:
            self._roll_back(name, candidate, stable, f"{candidate.label} at {where}: {counts}")
            return False
        elapsed = time.time() - (row["step_started"] or time.time())
        if elapsed < policy.interval_sec or calls < policy.min_requests:
            need = []
            if calls < policy.min_requests:
                need.append(f"{policy.min_requests - calls:g} more calls")
            if elapsed < policy.interval_sec:
                need.append(f"{policy.interval_sec - elapsed:.0f}s more")
            said = f"{candidate.label} at {where}: {counts}; waits for {' and '.join(need)}"
            self._progress(name, candidate, said, quiet=True)
            return True
        if step + 1 >= len(steps):
            self._promote(name, candidate, stable, f"{where}: {counts}")
            return False
        try:
            ctx.backend.canary(ctx.env, name, candidate.kept(), steps[step + 1])
        except SlessError as exc:
            self._roll_back(name, candidate, stable, f"{candidate.label} at {where}: {exc}")
            return False
        ctx.store.set_rollout(ctx.env, name, step=step + 1, step_started=time.time())
        self._base[name] = self._counts(name, candidate)
        said = (
            f"{candidate.label} takes {steps[step + 1]}% of the calls "
            f"(step {step + 2} of {len(steps) + 1}) after {where}: {counts}"
        )
        self._progress(name, candidate, said)
        logs.event(log, "rollout.step", f"{name}: {said}", env=ctx.env, function=name)
        return True

    def _promote(self, name: str, candidate: Revision, stable: Revision, last: str) -> None:
        ctx = self.ctx
        ctx.backend.switch_to(ctx.env, candidate.kept(), stable.kept())
        deployment = candidate.deployment()
        fn = deployment.function
        ctx.store.set_serving(ctx.env, name, serving.to_record(deployment), candidate.commit)
        ctx.serving.add(name)
        ctx.records.update(
            name,
            build_tag=fn.build_tag,
            revision=candidate.commit,
            restarts=0,
            last_exit=None,
            next_retry=None,
            spec={"hash": deployment.spec_hash, "replicas": fn.replicas, "http": fn.http},
        )
        self.revisions.deployed(deployment, candidate.commit)
        said = f"{candidate.label} takes every call after {last}; {stable.label} is kept"
        ctx.store.set_rollout(ctx.env, name, phase="Promoted", message=said)
        ctx.outcomes.pop(name, None)
        self._base.pop(name, None)
        where = {"env": ctx.env, "function": name}
        logs.event(log, "rollout.promoted", f"{name}: {said}", **where)

    def _roll_back(self, name: str, candidate: Revision, stable: Revision, why: str) -> None:
        ctx = self.ctx
        try:
            ctx.backend.canary(ctx.env, name, None, 0)
        except SlessError as exc:  # its replicas are gone either way: the stable serves
            log.warning("%s/%s: stopping %s: %s", ctx.env, name, candidate.label, exc)
        said = f"rolled back: {why}; {stable.label} takes every call"
        ctx.store.set_rollout(ctx.env, name, phase="RolledBack", message=said)
        ctx.outcomes[name] = Outcome(candidate.spec_hash, "RolledBack", said)
        self._base.pop(name, None)
        self.revisions.keep_runnable(name)
        where = {"env": ctx.env, "function": name}
        logs.event(log, "rollout.rolled_back", f"{name}: {said}", level=logging.WARNING, **where)

    def _progress(self, name: str, candidate: Revision, said: str, quiet: bool = False) -> None:
        ctx = self.ctx
        before = ctx.outcomes.get(name)
        ctx.outcomes[name] = Outcome(candidate.spec_hash, "Progressing", said)
        if not quiet or before is None or before.message != said:
            ctx.store.set_rollout(ctx.env, name, message=said)

    # --- counts -----------------------------------------------------------------------------

    def _counts(self, name: str, candidate: Revision) -> tuple[float, float]:
        """(calls, failures: 5xx and timeouts) the proxy counted for the candidate so far."""
        unit = f"{name}@{candidate.id}"
        calls = failures = 0.0
        for labels, value in list(METRICS.invocations.values.items()):
            found = dict(labels)
            if found.get("env") == self.ctx.env and found.get("name") == unit:
                calls += value
                if found.get("status", "").startswith("5"):
                    failures += value
        return calls, failures

    def _since_step(self, name: str, candidate: Revision) -> tuple[float, float]:
        calls, failures = self._counts(name, candidate)
        base = self._base.setdefault(name, (calls, failures))
        return calls - base[0], failures - base[1]

    def _running(self, name: str) -> Deployment:
        row = next(r for r in self.ctx.store.serving(self.ctx.env) if r["name"] == name)
        return serving.from_record(row["deployment"])

    def _tick_later(self) -> None:
        if self._ask_pass is None or self.ctx.stopping.is_set():
            return
        if self._timer is None or not self._timer.is_alive():
            self._timer = threading.Timer(TICK_SEC, self._ask_pass)
            self._timer.daemon = True
            self._timer.start()
