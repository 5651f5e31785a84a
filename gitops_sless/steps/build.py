"""Build: the builds a plan asks for, started in the background, one per tag and scope."""

from __future__ import annotations

import logging
import time

from .. import failure, logs, telemetry
from ..errors import SlessError, TransientError
from ..manifests.model import Function
from ..metrics import METRICS
from ..plan.backend import BuildFailed
from ..plan.planner import Plan
from ..source.snapshot import Snapshot
from .context import Context, PassState, log

__all__ = ["Build"]


class Build:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def start(self, planned: Plan, snapshot: Snapshot, current: PassState) -> int:
        """How many builds started (a tag already building is not started twice)."""
        ctx = self.ctx
        started = 0
        trace = telemetry.current()  # each build a span of this pass, wherever it runs
        for fn in planned.builds:
            key = ("build", fn.build_tag, ctx.backend.build_scope)
            if ctx.work.start(key, lambda fn=fn: self.traced(fn, snapshot, trace)):
                current.mine.add(key)
                started += 1
        return started

    def traced(self, fn: Function, snapshot: Snapshot, trace: object) -> None:
        attributes = {"sless.tag": fn.build_tag, "sless.runtime": fn.runtime}
        with telemetry.span("build", attributes, trace) as span:
            outcome = self.run(fn, snapshot)
            span.set_attribute("sless.result", outcome)
            if outcome == "Failed":
                span.failed(f"build {fn.build_tag} failed")

    def run(self, fn: Function, snapshot: Snapshot) -> str:
        """One build, to its end; its record says how it went. Succeeded, Failed or
        Interrupted."""
        ctx = self.ctx
        users = ", ".join(f.name for f in ctx.functions() if f.build_tag == fn.build_tag)
        scope = ctx.backend.build_scope
        ctx.store.start_build(fn.build_tag, fn.runtime, fn.source_id, fn.folder, scope)
        where = {"env": ctx.env, "function": users, "tag": fn.build_tag}
        logs.event(log, "build.started", f"{fn.build_tag} ({fn.folder or '.'})", **where)
        started = time.monotonic()
        try:
            build_log = ctx.backend.build(fn, snapshot)
        except TransientError as exc:  # stopped by a shutdown, files changed: not a failure
            ctx.store.delete_builds([fn.build_tag], scope)
            logs.event(log, "build.interrupted", str(exc), level=logging.WARNING, **where)
            return "Interrupted"
        except SlessError as exc:
            took = time.monotonic() - started
            ctx.store.finish_build(
                fn.build_tag, "Failed", _tail(exc), _build_error(exc), scope=scope
            )
            ctx.done["build_failed"] += 1
            METRICS.builds.inc(runtime=fn.runtime, result="Failed")
            METRICS.build_duration.observe(took)
            logs.event(
                log, "build.failed", f"{exc} after {took:.1f}s", level=logging.ERROR, **where
            )
            return "Failed"
        took = time.monotonic() - started
        image = ctx.backend.image(fn)
        ctx.store.finish_build(fn.build_tag, "Succeeded", build_log, image=image, scope=scope)
        ctx.done["built"] += 1
        METRICS.builds.inc(runtime=fn.runtime, result="Succeeded")
        METRICS.build_duration.observe(took)
        logs.event(log, "build.finished", f"{fn.build_tag} in {took:.1f}s", **where)
        return "Succeeded"


def _tail(exc: SlessError) -> str:
    return exc.log_tail if isinstance(exc, BuildFailed) else ""


def _build_error(exc: SlessError) -> str:
    """What the function says: the reason, then the log lines that tell why (the tag is shown
    beside it already; a one-line view keeps the reason)."""
    if not isinstance(exc, BuildFailed):
        return str(exc)
    if exc.summary is not None:  # the backend keeps the build's output out of the status
        return exc.summary
    tail = exc.log_tail if exc.log_tail.strip() else ""
    # the installer's own word on the first line: what a one-line view (status) shows
    said = failure.installer_cause(tail) if tail else None
    why = failure.cause(tail) if tail else ""
    return (
        f"build failed: {exc.reason}" + (f": {said}" if said else "") + (f"\n{why}" if why else "")
    )
