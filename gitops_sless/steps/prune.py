"""Prune: remove what the repository no longer declares, and what is known of it."""

from __future__ import annotations

from .. import logs
from ..plan.planner import Plan
from .context import Context, PassState, log

__all__ = ["Prune"]


class Prune:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def run(self, planned: Plan, current: PassState) -> None:
        ctx = self.ctx
        for name in planned.prunes:
            ctx.backend.remove(ctx.env, name)
            ctx.records.delete(name)  # and what it served
            ctx.serving.discard(name)
            ctx.outcomes.pop(name, None)
            ctx.deployments.pop(name, None)
            logs.event(log, "function.pruned", f"{name} removed", env=ctx.env, function=name)
            current.prunes += 1
            ctx.begin_row(current)
