"""The local backend's revisions: kept revisions as units of their own (``name@id``),
scaled to zero and reached at their own URLs; the switch to one (a rollback, or a
rollout's promotion); and a rollout's canary, the new revision beside the one serving,
taking a share of the calls.

A mixin of :class:`~.backend.LocalBackend`, which supplies the supervisor, the routes
and what each route says besides its upstreams.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from ..manifests.model import Function, Scale
from ..plan.backend import KeptRevision, SecretUnavailable
from ..state.routes import Canary
from .triggers import HttpTrigger, trigger

if TYPE_CHECKING:
    from .backend import LocalBackend

__all__ = ["RevisionUnits"]

log = logging.getLogger(__name__)


class RevisionUnits:
    def keep_revisions(
        self: LocalBackend, env: str, name: str, serving: KeptRevision, others: list[KeptRevision]
    ) -> None:
        wanted: dict[str, KeptRevision] = {}
        now = serving.deployment.function
        # a function disabled, or without an http trigger, takes no call: nor do the URLs
        # of its revisions (disabling it takes it offline, old code included)
        for kept in others if now.http and now.enabled else []:
            fn = kept.deployment.function
            if fn.http and fn.enabled:  # only what has an http trigger has a URL
                wanted[f"{name}@{kept.id}"] = kept
        canary = self._canaries.get((env, name))
        candidate = canary.name if canary is not None else None
        for unit in list(self._revision_units.get((env, name), ())):
            if unit not in wanted and unit != candidate:
                self._drop_unit(env, unit)
        aliases = {serving.label: name, serving.id: name} if now.http and now.enabled else {}
        for unit, kept in wanted.items():
            if unit == candidate:  # a rollout's: runs as the function does, not at zero
                aliases[kept.label] = aliases[kept.id] = unit
                continue
            deployment = kept.deployment
            try:
                spec = self._process_spec(env, deployment.function, deployment.env_vars)
            except SecretUnavailable as exc:  # it cannot start now: no URL until it can
                log.info("%s/%s %s is not runnable now: %s", env, name, kept.label, exc)
                self._drop_unit(env, unit)
                continue
            spec = dataclasses.replace(spec, revision=kept.id)
            self._http[(env, unit)] = self._kept_trigger(env, deployment.function)
            same = self.supervisor.spec_hash(env, unit) == deployment.spec_hash
            if not (same and self.supervisor.adopt_spec(spec, deployment.spec_hash)):
                self.supervisor.apply(spec, deployment.spec_hash, 0)  # started on a call
            self._revision_units.setdefault((env, name), set()).add(unit)
            aliases[kept.label] = aliases[kept.id] = unit
        self.routes.set_revisions(env, name, aliases)

    def _drop_unit(self: LocalBackend, env: str, unit: str) -> None:
        self._http.pop((env, unit), None)
        self.routes.remove(env, unit)
        self.supervisor.remove(env, unit)
        units = self._revision_units.get((env, unit.partition("@")[0]))
        if units is not None:
            units.discard(unit)

    def _drop_revisions(self: LocalBackend, env: str, name: str) -> None:
        """Every unit of ``name``'s kept revisions and candidate (it is removed)."""
        for unit in list(self._revision_units.pop((env, name), ())):
            self._drop_unit(env, unit)

    def _kept_trigger(self: LocalBackend, env: str, fn: Function) -> HttpTrigger:
        """A kept revision's route: scaled to zero, one replica started by a call, stopped
        after the function's idle time (a fixed count's: the default, 300 s)."""
        return trigger(fn, Scale(0, 1, idle_sec=fn.scale_in(env).idle_sec))

    def switch_to(
        self: LocalBackend, env: str, target: KeptRevision, retired: KeptRevision | None
    ) -> None:
        deployment = target.deployment
        fn, name = deployment.function, deployment.name
        unit = f"{name}@{target.id}"
        if retired is not None and fn.http and fn.enabled:
            spec = self._process_spec(env, fn, deployment.env_vars)
            retired_unit = f"{name}@{retired.id}"
            self._http[(env, retired_unit)] = self._kept_trigger(env, retired.deployment.function)
            self._set_trigger(env, fn)
            canary = self._canaries.pop((env, name), None)  # promoted, or left behind
            if self.supervisor.swap(env, name, unit, spec, deployment.spec_hash, retired.id):
                self._http.pop((env, unit), None)
                self.routes.remove(env, unit)
                units = self._revision_units.setdefault((env, name), set())
                units.discard(unit)
                units.add(retired_unit)
                self.supervisor.scale(env, name, self._initial_replicas(env, fn))
                self._schedule(spec, fn)
                return
            if canary is not None:  # not swapped: the rollout's split stays until a switch
                self._canaries[(env, name)] = canary
            self._http.pop((env, retired_unit), None)
        canary = self._canaries.get((env, name))
        self.apply(deployment)  # not warm: started beside what serves, then switched to
        if self._canaries.get((env, name)) is canary and canary is not None:
            del self._canaries[(env, name)]  # switched: the split is over
            self._republish(env, name)

    # --- a rollout's candidate ----------------------------------------------------------

    def canary(
        self: LocalBackend, env: str, name: str, candidate: KeptRevision | None, percent: int
    ) -> None:
        key = (env, name)
        before = self._canaries.get(key)
        unit = f"{name}@{candidate.id}" if candidate is not None else None
        if before is not None and before.name != unit:  # replaced, or no candidate any more
            del self._canaries[key]
            self._republish(env, name)
            self._drop_unit(env, before.name)
        if candidate is None or unit is None:
            return
        deployment = candidate.deployment
        fn = deployment.function
        policy = fn.scale_in(env)
        self._http[(env, unit)] = trigger(fn, policy if policy.autoscaled else None)
        replicas = min(max(policy.min, 1), policy.max)
        running = self.supervisor.status(env).get(unit)
        self._revision_units.setdefault(key, set()).add(unit)
        if self.supervisor.spec_hash(env, unit) != deployment.spec_hash:
            # started (and healthy) before it takes a call; ApplyFailed if it cannot be
            spec = self._process_spec(env, fn, deployment.env_vars)
            spec = dataclasses.replace(spec, revision=candidate.id)
            self.supervisor.apply(spec, deployment.spec_hash, replicas)
        elif running is None or running.wanted < replicas:  # kept at zero, or adopted
            self.supervisor.scale(env, unit, replicas)
        turn = before.turn if before is not None and before.name == unit else None
        canary = Canary(unit, percent) if turn is None else Canary(unit, percent, turn)
        self._canaries[key] = canary
        self._republish(env, name)

    def canary_counts(self: LocalBackend, env: str, name: str) -> tuple[int, int] | None:
        canary = self._canaries.get((env, name))
        return None if canary is None else (canary.counts[0], canary.counts[1])

    def canary_failure(self: LocalBackend, env: str, name: str) -> str | None:
        canary = self._canaries.get((env, name))
        status = self.supervisor.status(env).get(canary.name) if canary is not None else None
        if status is None or status.ready > 0 or not status.failing:
            return None
        return f"its replicas keep ending: {status.last_exit or 'no healthy answer'}"

    def _republish(self: LocalBackend, env: str, name: str) -> None:
        """``name``'s route again, with what it says besides its upstreams as it is now."""
        self.supervisor.publish(env, name)
