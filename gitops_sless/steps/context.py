"""What the steps of one environment's passes share, and what one pass has done so far."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import logs
from ..manifests.model import DesiredState, Function
from ..plan.backend import Backend, Deployment
from ..state.inflight import InFlight
from ..state.phases import Outcome
from ..state.records import Records
from ..state.store import Store

__all__ = ["Context", "PassState", "short"]

log = logging.getLogger("gitops_sless.reconciler")  # one logger for every step of a pass


@dataclass
class PassState:
    """One pass while it runs: its history row is written only once it changes something."""

    trigger: str
    started: float
    sync_id: int | None = None
    revision: str | None = None
    started_work: int = 0
    applies: int = 0
    failures: int = 0
    prunes: int = 0
    mine: set[Hashable] = field(default_factory=set)  # work it started and may wait for

    @property
    def changed(self) -> bool:
        return self.sync_id is not None


@dataclass(eq=False)
class Context:
    """The reconciler of one environment, as its steps see it between passes."""

    env: str
    backend: Backend
    store: Store
    work: InFlight  # builds and job runs, shared with the other environments' reconcilers
    pool: ThreadPoolExecutor  # deploys of one pass run side by side
    build_retry_sec: float = 300.0
    clock: Callable[[], float] = time.time  # the time deploy backoffs are counted in
    stopping: threading.Event = field(default_factory=threading.Event)
    records: Records = field(init=False)
    desired: DesiredState | None = None  # the last state loaded
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # deploys that did not start
    serving: set[str] = field(init=False)  # functions with a deploy written down
    built: set[str] = field(default_factory=set)  # tags known built: a tag never changes
    deployments: dict[str, tuple[Function, tuple[str | None, ...], Deployment]] = field(
        default_factory=dict
    )
    # finished in the background since the last pass ended
    done: dict[str, int] = field(default_factory=lambda: {"built": 0, "build_failed": 0, "jobs": 0})

    def __post_init__(self) -> None:
        self.records = Records(self.store, self.env)
        self.serving = {row["name"] for row in self.store.serving(self.env)}

    def functions(self) -> list[Function]:
        """The functions of the last state loaded."""
        return list(self.desired.functions.values()) if self.desired else []

    def builds_here(self, key: Hashable) -> bool:
        """Builds whose image this environment may run: of its own scope (trust) only."""
        return (
            isinstance(key, tuple) and key[0] == "build" and key[2:] == (self.backend.build_scope,)
        )

    def begin_row(self, current: PassState) -> None:
        """The pass changes something: it gets a row of its own in the history."""
        if current.sync_id is None:
            current.sync_id = self.store.begin_sync(self.env, current.trigger, current.started)

    def run_all(self, step: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        return [future.result() for future in [self.pool.submit(step, item) for item in items]]

    def warn(self, event: str, name: str, message: str) -> None:
        where = {"env": self.env, "function": name}
        logs.event(log, event, f"{name}: {message}", level=logging.WARNING, **where)


def short(revision: str | None) -> str | None:
    return revision[:12] if revision else None
