"""At start-up, before anything is fetched: start what served when the last reconciler
stopped, exactly as it was (an unreachable remote then changes nothing)."""

from __future__ import annotations

from .. import logs
from ..errors import SlessError
from ..plan.backend import Deployment
from ..state import serving
from .context import Context, log, short

__all__ = ["Restore"]


class Restore:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.done = False

    def run(self) -> None:
        ctx = self.ctx
        self.done = True
        rows = ctx.store.serving(ctx.env)
        if not rows:
            return
        ctx.backend.refresh(ctx.env)
        running = ctx.backend.deployed(ctx.env)
        todo = []
        for row in rows:
            try:
                deployment = serving.from_record(row["deployment"])
            except (KeyError, TypeError, ValueError) as exc:
                ctx.warn("function.unrestored", row["name"], f"unreadable record: {exc}")
                continue
            if running.get(deployment.name) == deployment.spec_hash:
                continue  # still running (a cluster keeps what it runs)
            if not ctx.backend.is_built(deployment.function):
                why = f"its build {deployment.function.build_tag} is gone; it is built again"
                ctx.warn("function.unrestored", deployment.name, why)
                continue
            todo.append((deployment, row["revision"]))
        ctx.run_all(lambda item: self._start(*item), todo)

    def _start(self, deployment: Deployment, revision: str | None) -> None:
        ctx = self.ctx
        try:
            ctx.backend.apply(deployment, revision)
        except SlessError as exc:
            ctx.warn("function.unrestored", deployment.name, str(exc))
            return
        fn = deployment.function
        where = {"env": ctx.env, "function": fn.name, "revision": short(revision)}
        logs.event(log, "function.restored", f"{fn.name} serves {fn.build_tag} again", **where)
