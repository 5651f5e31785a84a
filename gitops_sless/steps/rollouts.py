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

Who else should hear of a rollout (the forge's commit status) is told by ``on_verdict``
with a :class:`Verdict`: when it starts, is promoted, is rolled back or is withdrawn. Its words are
public (anyone reads a commit status): names, steps and the numbers, never a function's
output or an error's text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import logs
from ..errors import SlessError
from ..manifests.model import Rollout, is_preview
from ..plan.backend import Deployment, SecretUnavailable
from ..plan.planner import Plan
from ..state import serving
from ..state.phases import Outcome
from ..state.revisions import Revision
from .context import Context, log
from .revisions import Revisions

__all__ = ["Rollouts", "Verdict"]

TICK_SEC = 1.0  # while a rollout is under way, a pass looks at it this often
WAITS, STEPPED, ENDED = "waits", "stepped", "ended"  # what a look at a step did


@dataclass(frozen=True)
class Verdict:
    """A rollout started (``Progressing``), ``Promoted`` or ``RolledBack``, in words anyone
    may read: ``said`` names the function, the revisions, the step and the numbers only."""

    env: str
    function: str
    candidate: str  # its label: r4
    stable: str
    commit: str  # the commit that brought the candidate
    phase: str  # Progressing | Promoted | RolledBack | Withdrawn
    said: str


class Rollouts:
    def __init__(
        self,
        ctx: Context,
        revisions: Revisions,
        ask_pass: Callable[[], Any] | None = None,
        between_passes: Callable[[Callable[[], bool]], bool] | None = None,
        on_verdict: Callable[[Verdict], None] | None = None,
    ) -> None:
        """``between_passes(task)`` runs ``task`` while no pass runs (the rollouts are
        looked at every second that way); ``ask_pass()`` asks for a pass (a verdict
        changed a phase). Without them, only passes look. ``on_verdict`` hears each
        rollout start and end (it must return at once: it runs in the pass)."""
        self.ctx = ctx
        self._on_verdict = on_verdict
        self.revisions = revisions
        self._ask_pass = ask_pass
        self._between_passes = between_passes
        self._started: set[str] = set()  # rollouts whose candidate this process started
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
        # under way, or judged and rolled back (a withdrawn one may be rolled out again)
        taken = {
            (name, row["candidate"])
            for name, row in rows.items()
            if row["phase"] in ("Progressing", "RolledBack")
        }
        held = [d for d in planned.applies if (d.name, d.spec_hash) in taken]
        planned.applies = [d for d in planned.applies if (d.name, d.spec_hash) not in taken]
        planned.held.update((d.name, d.spec_hash) for d in held)

    def start(self, deployment: Deployment, commit: str | None) -> bool | None:
        """Start the rollout of ``deployment`` (replacing one under way); False when its
        candidate could not start (rolled back at once), None when it waits for a secret
        (tried again on every pass, as a deploy is)."""
        ctx = self.ctx
        name = deployment.name
        policy = deployment.function.rollout or Rollout()
        stable = self.revisions.serving(name)
        candidate = self.revisions.record(deployment, commit)
        if stable is None:  # what serves was never recorded (an old state folder)
            stable = self.revisions.record(self._running(name), None)
        row = {"candidate": candidate.spec_hash, "stable": stable.spec_hash, "step": 0}
        self._tell_withdrawn(name, f"replaced by {candidate.label}", candidate.spec_hash)
        try:
            ctx.backend.canary(ctx.env, name, candidate.kept(), policy.steps[0])
        except SecretUnavailable as exc:
            ctx.outcomes[name] = Outcome(candidate.spec_hash, "Pending", str(exc))
            return None
        except SlessError as exc:
            ctx.store.set_rollout(ctx.env, name, phase="Progressing", **row)
            why = f"{candidate.label} did not start: {exc}"
            self._roll_back(name, candidate, stable, why, "did not start; rolled back")
            return False
        ctx.store.set_rollout(
            ctx.env, name, phase="Progressing", step_started=time.time(), message=None, **row
        )
        self._started.add(name)
        self._base[name] = self._counts(name)
        said = (
            f"{candidate.label} takes {policy.steps[0]}% of the calls "
            f"(step 1 of {len(policy.steps) + 1}), {stable.label} the rest"
        )
        self._progress(name, candidate, said)
        logs.event(log, "rollout.started", f"{name}: {said}", env=ctx.env, function=name)
        step = f"{policy.steps[0]}% (step 1 of {len(policy.steps) + 1})"
        self._tell(
            name, candidate, stable, "Progressing", f"rollout of {name} {candidate.label}: {step}"
        )
        self.revisions.keep_runnable(name)  # the candidate's own URL
        self._tick_later()
        return True

    def advance(self) -> bool:
        """Every rollout under way: a verdict where one is due. True when one ended or
        took a step (the function's phase changed: a pass writes it)."""
        ctx = self.ctx
        under_way = changed = False
        for name, row in ctx.store.rollouts(ctx.env).items():
            if row["phase"] != "Progressing":
                continue
            candidate = self.revisions.by_hash(name, row["candidate"])
            stable = self.revisions.by_hash(name, row["stable"])
            if candidate is None or stable is None:  # its revisions are gone: nothing to judge
                self._withdraw(name, "withdrawn: its revisions are no longer kept")
                changed = True
                continue
            wanted = ctx.deployments.get(name)
            if wanted is not None and wanted[2].spec_hash == stable.spec_hash:
                # a commit asks for what serves again (a revert): nothing to roll out
                why = f"{candidate.label} withdrawn: git asks for {stable.label} again"
                self._withdraw(name, why)
                self.revisions.keep_runnable(name)
                changed = True
                continue
            if name not in self._started and not self._resume(name, row, candidate, stable):
                changed = True  # rolled back: it could not start again
                continue
            verdict = self._judge(name, row, candidate, stable)
            under_way = under_way or verdict != ENDED
            changed = changed or verdict != WAITS
        if under_way:
            self._tick_later()
        return changed

    def restored(self) -> None:
        """At start-up: the outcome of every rollout that ended is shown again; those under
        way start their candidates again on the first look (see :meth:`_resume`)."""
        ctx = self.ctx
        for name, row in ctx.store.rollouts(ctx.env).items():
            candidate = self.revisions.by_hash(name, row["candidate"])
            if candidate is None:
                continue
            if row["phase"] == "RolledBack":
                ctx.outcomes[name] = Outcome(candidate.spec_hash, "RolledBack", row["message"])
            elif row["phase"] == "Progressing":
                ctx.outcomes[name] = Outcome(
                    candidate.spec_hash, "Progressing", row["message"] or ""
                )
                self._resume(name, row, candidate, self.revisions.by_hash(name, row["stable"]))

    def _resume(
        self, name: str, row: dict[str, Any], candidate: Revision, stable: Revision | None
    ) -> bool:
        """A rollout this process did not start: its candidate beside the stable revision at
        its step again, the step's calls counted from now (the counts are this process's).
        False when it could not start (rolled back); True when it runs or waits for a
        secret."""
        ctx = self.ctx
        policy = candidate.deployment().function.rollout or Rollout()
        step = min(row["step"], len(policy.steps) - 1)
        try:
            ctx.backend.canary(ctx.env, name, candidate.kept(), policy.steps[step])
        except SecretUnavailable as exc:
            ctx.outcomes[name] = Outcome(candidate.spec_hash, "Pending", str(exc))
            self._tick_later()
            return True
        except SlessError as exc:
            if stable is not None:
                why = f"{candidate.label} did not start: {exc}"
                self._roll_back(name, candidate, stable, why, "did not start; rolled back")
            return False
        self._started.add(name)
        row["step_started"] = time.time()
        ctx.store.set_rollout(ctx.env, name, step_started=row["step_started"])
        self._base[name] = self._counts(name)
        self.revisions.keep_runnable(name)
        self._tick_later()
        return True

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    # --- a verdict --------------------------------------------------------------------------

    def _judge(self, name: str, row: dict[str, Any], candidate: Revision, stable: Revision) -> str:
        """One rollout's step: it WAITS (for calls, time or a secret), it STEPPED to the next
        share, or it ENDED (promoted or rolled back)."""
        ctx = self.ctx
        if name not in self._started:  # its candidate waits for a secret
            return WAITS
        policy = candidate.deployment().function.rollout or Rollout()
        steps = policy.steps
        step = min(row["step"], len(steps) - 1)
        share = steps[step]
        where = f"step {step + 1} of {len(steps) + 1} ({share}%)"
        broken = ctx.backend.canary_failure(ctx.env, name)
        if broken is not None:
            why = f"{candidate.label} at {where}: {broken}"
            public = f"rolled back at {where}: its replicas keep ending"
            self._roll_back(name, candidate, stable, why, public)
            return ENDED
        calls, failures = self._since_step(name)
        rate = failures / calls if calls else 0.0
        limit = policy.max_error_rate
        counts = f"{failures:g} of {calls:g} calls failed ({rate:.1%}, at most {limit:.1%})"
        if calls and calls >= policy.min_requests and rate > policy.max_error_rate:
            why = f"{candidate.label} at {where}: {counts}"
            self._roll_back(name, candidate, stable, why, f"rolled back at {where}: {counts}")
            return ENDED
        elapsed = time.time() - (row["step_started"] or time.time())
        if elapsed < policy.interval_sec or calls < policy.min_requests:
            need = []
            if calls < policy.min_requests:
                need.append(f"{policy.min_requests - calls:g} more calls")
            if elapsed < policy.interval_sec:
                need.append(f"{policy.interval_sec - elapsed:.0f}s more")
            said = f"{candidate.label} at {where}: {counts}; waits for {' and '.join(need)}"
            self._progress(name, candidate, said, quiet=True)
            return WAITS
        if step + 1 >= len(steps):
            self._promote(name, candidate, stable, f"{where}: {counts}")
            return ENDED
        try:
            ctx.backend.canary(ctx.env, name, candidate.kept(), steps[step + 1])
        except SlessError as exc:
            public = f"rolled back at {where}: its next step did not start"
            self._roll_back(name, candidate, stable, f"{candidate.label} at {where}: {exc}", public)
            return ENDED
        ctx.store.set_rollout(ctx.env, name, step=step + 1, step_started=time.time())
        self._base[name] = self._counts(name)
        said = (
            f"{candidate.label} takes {steps[step + 1]}% of the calls "
            f"(step {step + 2} of {len(steps) + 1}) after {where}: {counts}"
        )
        self._progress(name, candidate, said)
        logs.event(log, "rollout.step", f"{name}: {said}", env=ctx.env, function=name)
        return STEPPED

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
        self._started.discard(name)
        where = {"env": ctx.env, "function": name}
        logs.event(log, "rollout.promoted", f"{name}: {said}", **where)
        self._tell(
            name, candidate, stable, "Promoted", f"{name} {candidate.label} promoted after {last}"
        )

    def _roll_back(
        self, name: str, candidate: Revision, stable: Revision, why: str, public: str
    ) -> None:
        """``why`` is for the function's status and the log; ``public`` for ``on_verdict``
        (numbers, never an error's text): "rolled back at step 1 of 3 (10%): ..."."""
        ctx = self.ctx
        try:
            ctx.backend.canary(ctx.env, name, None, 0)
        except SlessError as exc:  # its replicas are gone either way: the stable serves
            log.warning("%s/%s: stopping %s: %s", ctx.env, name, candidate.label, exc)
        said = f"rolled back: {why}; {stable.label} takes every call"
        ctx.store.set_rollout(ctx.env, name, phase="RolledBack", message=said)
        ctx.outcomes[name] = Outcome(candidate.spec_hash, "RolledBack", said)
        self._base.pop(name, None)
        self._started.discard(name)
        self.revisions.keep_runnable(name)
        where = {"env": ctx.env, "function": name}
        logs.event(log, "rollout.rolled_back", f"{name}: {said}", level=logging.WARNING, **where)
        self._tell(name, candidate, stable, "RolledBack", f"{name} {candidate.label} {public}")

    def _tell(
        self, name: str, candidate: Revision, stable: Revision, phase: str, said: str
    ) -> None:
        """``on_verdict`` hears it; what it does with it never stops a rollout."""
        if self._on_verdict is None or not candidate.commit:
            return
        verdict = Verdict(
            self.ctx.env, name, candidate.label, stable.label, candidate.commit, phase, said
        )
        try:
            self._on_verdict(verdict)
        except Exception:  # a listener's bug must not end a pass
            log.exception("%s/%s: telling of the rollout failed", self.ctx.env, name)

    def _tell_withdrawn(self, name: str, public: str, unless: str | None = None) -> None:
        """The rollout under way of ``name`` (unless its candidate's spec hash is ``unless``)
        ends without a verdict: its commit's status must not stay pending for good."""
        row = self.ctx.store.rollout_of(self.ctx.env, name)
        if row is None or row["phase"] != "Progressing" or row["candidate"] == unless:
            return
        candidate = self.revisions.by_hash(name, row["candidate"])
        stable = self.revisions.by_hash(name, row["stable"])
        if candidate is not None and stable is not None:
            said = f"{name} {candidate.label} withdrawn before a verdict: {public}"
            self._tell(name, candidate, stable, "Withdrawn", said)

    def _withdraw(self, name: str, why: str) -> None:
        """Stop a rollout without a verdict: every call to what serves, and the same version
        may be rolled out again (a later commit asking for it)."""
        ctx = self.ctx
        self._tell_withdrawn(name, "not judged")
        try:
            ctx.backend.canary(ctx.env, name, None, 0)
        except SlessError as exc:
            log.warning("%s/%s: stopping the candidate: %s", ctx.env, name, exc)
        ctx.store.set_rollout(ctx.env, name, phase="Withdrawn", message=why)
        ctx.outcomes.pop(name, None)
        self._base.pop(name, None)
        self._started.discard(name)
        logs.event(log, "rollout.withdrawn", f"{name}: {why}", env=ctx.env, function=name)

    def _progress(self, name: str, candidate: Revision, said: str, quiet: bool = False) -> None:
        ctx = self.ctx
        before = ctx.outcomes.get(name)
        ctx.outcomes[name] = Outcome(candidate.spec_hash, "Progressing", said)
        if not quiet or before is None or before.message != said:
            ctx.store.set_rollout(ctx.env, name, message=said)

    # --- counts -----------------------------------------------------------------------------

    def _counts(self, name: str) -> tuple[float, float]:
        """(calls, failures: 5xx and timeouts) of the candidate's share so far, as the proxy
        counted them (calls at its own URL are not its share: they are left out)."""
        counts = self.ctx.backend.canary_counts(self.ctx.env, name)
        return (0.0, 0.0) if counts is None else (float(counts[0]), float(counts[1]))

    def _since_step(self, name: str) -> tuple[float, float]:
        calls, failures = self._counts(name)
        base = self._base.setdefault(name, (calls, failures))
        return calls - base[0], failures - base[1]

    def _running(self, name: str) -> Deployment:
        row = next(r for r in self.ctx.store.serving(self.ctx.env) if r["name"] == name)
        return serving.from_record(row["deployment"])

    def _tick_later(self) -> None:
        if self._between_passes is None or self.ctx.stopping.is_set():
            return
        if self._timer is None or not self._timer.is_alive():
            self._timer = threading.Timer(TICK_SEC, self._tick)
            self._timer.daemon = True
            self._timer.start()

    def _tick(self) -> None:
        """A look at the rollouts between passes (no fetch: a git host that is down never
        holds a verdict back); a pass is asked for when one ended or took a step."""
        if self._between_passes is None or self.ctx.stopping.is_set():
            return
        self._timer = None  # this one is over: advance() may set the next
        try:
            changed = self._between_passes(self.advance)
        except Exception:  # a bug must not stop the rollouts for good: the next pass looks
            log.exception("rollouts: a look between passes failed")
            changed = True
        if changed and self._ask_pass is not None:
            self._ask_pass()
