"""The Kubernetes backend's revisions: kept revisions as Deployments and Services of their
own (:mod:`.units`), reached at their own URLs; a rollout's candidate beside the
function, taking its share of the calls (the proxy splits them, and with ``--gateway``
the function's HTTPRoute carries two weighted ``backendRefs``); and the switch to a
revision (a rollback, a rollout's promotion).

A switch to a revision that is warm (a candidate, a kept revision with a replica) is
at once: every call goes to that revision's Service while the function's own
Deployment rolls over to it, and back to the function's Service once it has (a
*bridge*, ended by the pass that sees the rollout done). A switch to one at zero is an
apply, as a deploy is.

What a rollout is at lives in the status store; what runs, in the cluster: after a
restart, the rollout's candidate is found as it was (same name, same spec: nothing is
written) and takes its share again. A mixin of :class:`~.backend.KubeBackend`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..errors import SlessError
from ..plan.backend import ApplyFailed, KeptRevision
from ..state.routes import Canary
from .activator import rendered_timeout
from .renderer import FUNCTION_HASH, render_http_route, route_timeout
from .status import available_replicas, rolled_out, start_problem
from .units import (
    is_candidate,
    object_name,
    pod_selector,
    render_revision,
    revision_route,
    split_route,
)
from .view import View, annotation

if TYPE_CHECKING:
    from .backend import KubeBackend

__all__ = ["RevisionUnits", "Traffic"]

log = logging.getLogger(__name__)

Key = tuple[str, str]
Traffic = tuple[str, int]  # (the revision's label, its percent): a candidate's share


class RevisionUnits:
    def _revisions_init(self) -> None:
        self._canaries: dict[Key, Canary] = {}
        self._shares: dict[Key, Traffic] = {}  # what the Function resource's status shows
        self._bridges: dict[Key, str] = {}  # -> the spec hash the Deployment rolls to
        self._kept: dict[Key, dict[str, KeptRevision]] = {}  # -> unit -> revision kept
        self._judged: set[Key] = set()  # functions this process ran a rollout or switch of

    # --- kept revisions -----------------------------------------------------------------

    def keep_revisions(
        self: KubeBackend, env: str, name: str, serving: KeptRevision, others: list[KeptRevision]
    ) -> None:
        view = self.view(env)
        now = serving.deployment.function
        wanted: dict[str, KeptRevision] = {}
        # a function disabled, or without an http trigger, takes no call: nor do the URLs of
        # its revisions (disabling it takes it offline, old code included)
        for kept in others if now.http and now.enabled else []:
            fn = kept.deployment.function
            if fn.http and fn.enabled:
                wanted[f"{name}@{kept.id}"] = kept
        busy = self._busy_units(env, name)
        aliases = {serving.label: name, serving.id: name} if now.http and now.enabled else {}
        kept_now: dict[str, KeptRevision] = {}
        for unit, kept in wanted.items():
            if unit not in busy and not self._keep(view, kept):
                continue
            kept_now[unit] = kept
            aliases[kept.label] = aliases[kept.id] = unit
        with self._lock:
            self._kept[(env, name)] = kept_now
        for unit in view.revisions(name) - set(kept_now) - busy:
            self._drop_unit(view, unit)
        self.routes.set_revisions(env, name, aliases)
        for unit in kept_now:
            self._republish(view, unit)
            self._switch(view, unit)

    def _keep(self: KubeBackend, view: View, kept: KeptRevision) -> bool:
        """``kept``'s objects as a kept revision's (at zero until a call); False: it cannot
        run (its image is no longer recorded)."""
        try:
            image = self._image(kept.deployment.function)
        except ApplyFailed as exc:
            log.info(
                "%s/%s %s is not runnable: %s", view.env, kept.deployment.name, kept.label, exc
            )
            return False
        self.applier.apply(view, render_revision(kept, self.config, image, False))
        return True

    def _busy_units(self: KubeBackend, env: str, name: str) -> set[str]:
        """The units a rollout or a switch uses now: not kept at zero, never dropped. A
        candidate's Deployment not taking calls yet is one too: after a restart, its
        rollout resumes once the revisions are kept (it must find it running as it ran)."""
        with self._lock:
            canary = self._canaries.get((env, name))
            resuming = (env, name) not in self._judged
        if canary is not None:
            return {canary.name}
        if not resuming:
            return set()
        view = self.view(env)
        return {
            u for u in view.revisions(name) if is_candidate(view.get("Deployment", object_name(u)))
        }

    def _drop_unit(self: KubeBackend, view: View, unit: str) -> None:
        self.routes.remove(view.env, unit)
        self.applier.delete(view, view.of_function(unit))

    def _drop_revisions(self: KubeBackend, view: View, name: str) -> None:
        """Every object of ``name``'s revisions (it is removed)."""
        with self._lock:
            self._canaries.pop((view.env, name), None)
            self._shares.pop((view.env, name), None)
            self._bridges.pop((view.env, name), None)
            self._kept.pop((view.env, name), None)
        self.routes.set_revisions(view.env, name, {})
        for unit in view.revisions(name):
            self._drop_unit(view, unit)

    def _revision_route(self: KubeBackend, view: View, unit: str) -> None:
        """With --gateway, a kept revision's HTTPRoute while one of its replicas serves; none
        at zero (its URL is then the reconciler's, which starts it)."""
        if not self.config.gateway or not self.client.may_write():
            return
        name = unit.partition("@")[0]
        with self._lock:
            kept = self._kept.get((view.env, name), {}).get(unit)
        live = view.get("Deployment", object_name(unit))
        route = view.get("HTTPRoute", object_name(unit))
        with self._lock:
            zeroing = (view.env, unit) in self._zeroing
        try:
            if kept is not None and live is not None and available_replicas(live) and not zeroing:
                fn = kept.deployment.function
                self.applier.apply(view, [revision_route(kept, route_timeout(fn), self.config)])
            elif route is not None:
                self.applier.delete(view, [route])
        except SlessError as exc:
            log.warning("HTTPRoute %s/%s: not written: %s", view.namespace, unit, exc)

    # --- a rollout's candidate ----------------------------------------------------------

    def canary(
        self: KubeBackend, env: str, name: str, candidate: KeptRevision | None, percent: int
    ) -> None:
        view = self.view(env)
        key = (env, name)
        unit = f"{name}@{candidate.id}" if candidate is not None else None
        with self._lock:
            before = self._canaries.get(key)
            self._judged.add(key)
        if before is not None and before.name != unit:  # replaced, or no candidate any more
            self._end_split(view, name)
            with self._lock:
                kept = self._kept.get(key, {}).get(before.name)
            if kept is None:
                self._drop_unit(view, before.name)
            else:  # kept runnable: at zero, as every kept revision
                self._keep(view, kept)
        if candidate is None or unit is None:
            return
        fn = candidate.deployment.function
        try:
            self.applier.apply(view, render_revision(candidate, self.config, self._image(fn), True))
            policy = fn.scale_in(env)
            if policy.autoscaled:  # at least what the function runs, one at least
                wanted = min(max(policy.min, 1), policy.max)
                if self._replicas(view, unit) < wanted:
                    self.scale(env, unit, wanted)
            self._wait_serving(view, unit)
        except SlessError:
            if before is None or before.name != unit:  # it never took a call: it goes
                self._drop_unit(view, unit)
            raise
        turn = before.turn if before is not None and before.name == unit else None
        canary = Canary(unit, percent) if turn is None else Canary(unit, percent, turn)
        self._split(view, name, canary, (candidate.label, percent))

    def canary_counts(self: KubeBackend, env: str, name: str) -> tuple[int, int] | None:
        with self._lock:
            canary = self._canaries.get((env, name))
        return None if canary is None else (canary.counts[0], canary.counts[1])

    def canary_failure(self: KubeBackend, env: str, name: str) -> str | None:
        with self._lock:
            canary = self._canaries.get((env, name))
        if canary is None:
            return None
        view = self.view(env)
        live = view.get("Deployment", object_name(canary.name))
        if live is not None and available_replicas(live):
            return None  # it serves: its calls judge it (a LIST only when it does not)
        if live is None:
            return "its Deployment is gone"
        pods = self.client.list("Pod", view.namespace, pod_selector(env, canary.name))
        return start_problem(pods)

    def _wait_serving(self: KubeBackend, view: View, unit: str) -> None:
        """Until a replica of ``unit`` serves: ApplyFailed when its pods say none will (a
        crash loop, an image that cannot be pulled), or after the progress deadline."""
        deployments = view.informer("Deployment")
        deadline = _now() + self.config.progress_deadline_sec
        next_look = 0.0
        while True:
            seen = deployments.version()
            live = view.get("Deployment", object_name(unit))
            if live is not None and available_replicas(live):
                return
            now = _now()
            if now >= deadline:
                raise ApplyFailed(
                    f"{unit}: no replica served within {self.config.progress_deadline_sec}s"
                )
            if now >= next_look:
                next_look = now + 1.0
                pods = self.client.list("Pod", view.namespace, pod_selector(view.env, unit))
                problem = start_problem(pods)
                if problem is not None:
                    raise ApplyFailed(f"{unit}: {problem}")
            deployments.wait_change(seen, max(0.0, min(next_look, deadline) - _now()))

    def _split(self: KubeBackend, view: View, name: str, canary: Canary, share: Traffic) -> None:
        """``canary`` takes its share of ``name``'s calls: through the proxy at once, and
        with --gateway through the function's HTTPRoute."""
        key = (view.env, name)
        with self._lock:
            self._canaries[key] = canary
            self._shares[key] = share
        self._republish(view, name)
        route = self._plain_route(view, name)
        if route is not None:
            self.applier.apply(view, [split_route(route, canary.name, canary.percent)])

    def _end_split(self: KubeBackend, view: View, name: str) -> None:
        """Every call of ``name`` to its own Service again."""
        key = (view.env, name)
        with self._lock:
            self._canaries.pop(key, None)
            self._shares.pop(key, None)
            self._bridges.pop(key, None)
        self._republish(view, name)
        route = self._plain_route(view, name)
        if route is not None:
            with self._lock:
                zeroing = key in self._zeroing
            self.applier.apply(view, self.switch.moded(view, [route], zeroing))

    def _plain_route(self: KubeBackend, view: View, name: str) -> dict[str, Any] | None:
        """The function's HTTPRoute as rendered (with --gateway, for an http function)."""
        live = view.get("Deployment", name)
        if not self.config.gateway or live is None or view.get("HTTPRoute", name) is None:
            return None
        return render_http_route(view.env, name, rendered_timeout(live), self.config)

    def traffic(self: KubeBackend, env: str, name: str) -> Traffic | None:
        """The share a candidate takes of ``name``'s calls now, for its status; None: none."""
        with self._lock:
            return self._shares.get((env, name))

    # --- switching ----------------------------------------------------------------------

    def switch_to(
        self: KubeBackend, env: str, target: KeptRevision, retired: KeptRevision | None
    ) -> None:
        view = self.view(env)
        deployment = target.deployment
        name, fn = deployment.name, deployment.function
        unit = f"{name}@{target.id}"
        live = view.get("Deployment", object_name(unit))
        warm = live is not None and available_replicas(live) > 0 and fn.http and fn.enabled
        self.apply(deployment)  # the function's Deployment rolls over to ``target``
        if not warm:
            with self._lock:
                splitting = (env, name) in self._canaries
            if splitting:
                self._end_split(view, name)
            return
        # at once: every call to the warm revision until the function's Deployment serves it
        with self._lock:
            self._bridges[(env, name)] = deployment.spec_hash
            self._judged.add((env, name))
        self._split(view, name, Canary(unit, 100), (target.label, 100))
        self._end_bridges(view)  # the Deployment may serve it already

    def _end_bridges(self: KubeBackend, view: View) -> None:
        """Bridges whose function's Deployment now serves what they bridged to: ended, and
        the revision's objects dropped (the function's own run it now)."""
        with self._lock:
            bridges = [(k[1], h) for k, h in self._bridges.items() if k[0] == view.env]
        for name, spec_hash in bridges:
            live = view.get("Deployment", name)
            if live is None or not rolled_out(live):
                continue
            if annotation(live, FUNCTION_HASH) != spec_hash:
                continue
            with self._lock:
                canary = self._canaries.get((view.env, name))
                if canary is not None:
                    self._kept.get((view.env, name), {}).pop(canary.name, None)
            self._end_split(view, name)
            if canary is not None:
                self._drop_unit(view, canary.name)
            log.info("%s/%s: its Deployment serves the revision it was switched to", view.env, name)


def _now() -> float:
    return time.monotonic()
