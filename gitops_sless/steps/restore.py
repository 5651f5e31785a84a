"""At start-up, before anything is fetched: start what served when the last reconciler
stopped, exactly as it was (an unreachable remote then changes nothing), its calls held
meanwhile; or, after a restart in place, take over the replicas that still serve it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

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

    def run(self, beside: Callable[[Mapping[str, str]], None]) -> None:
        """Adopt what still runs and start the rest; ``beside`` is given the spec hash of
        each function about to start, once its calls wait for it and before it starts, to
        make the URLs of its kept revisions answer from then on too."""
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
                # still running: a cluster keeps what it runs, and a restart in place
                # hands its replicas over
                self._adopt(deployment)
                continue
            if not ctx.backend.is_built(deployment.function):
                why = f"its build {deployment.function.build_tag} is gone; it is built again"
                ctx.warn("function.unrestored", deployment.name, why)
                continue
            todo.append((deployment, row["revision"]))
        for deployment, _ in todo:
            ctx.backend.restoring(deployment)  # its calls wait for the start
        # not after the starts: a call at a kept revision's URL would find none meanwhile
        beside({deployment.name: deployment.spec_hash for deployment, _ in todo})
        ctx.run_all(lambda item: self._start(*item), todo)

    def _adopt(self, deployment: Deployment) -> None:
        try:
            self.ctx.backend.adopt(deployment)
        except SlessError as exc:
            self.ctx.warn("function.unrestored", deployment.name, str(exc))

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
