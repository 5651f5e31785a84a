"""The controllers of the fake cluster: Deployment (pods and status, no ReplicaSets),
Job (pods, backoff, deadline, status, ttlSecondsAfterFinished), CronJob (on demand only)
and the kubelet (``kubelet.py``). A work queue of object keys is filled by every store
change; ``process()`` runs right after each write request and on a background tick (every
50 ms) that also fires delayed work (Job durations, deadlines, TTLs, crash-loop restarts)."""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import math
import threading
import time
from typing import Any

from . import cronjobs
from .apply import track_update
from .cronjobs import finished as _finished
from .defaults import apply_defaults
from .kubelet import Kubelet, conditions, owner_of
from .ops import Api
from .resources import ApiError, clone, now_iso, suffix
from .store import Key, Obj, Store

REVISION = "deployment.kubernetes.io/revision"


def template_hash(template: Obj) -> str:
    digest = hashlib.sha256(repr(sorted_json(template)).encode()).digest()
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    return "".join(alphabet[b % len(alphabet)] for b in digest[:10])


def sorted_json(value: Any) -> Any:
    if isinstance(value, dict):
        return sorted((k, sorted_json(v)) for k, v in value.items())
    if isinstance(value, list):
        return [sorted_json(v) for v in value]
    return value


def _scaled(value: Any, replicas: int, up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        exact = replicas * int(value[:-1]) / 100
        return math.ceil(exact) if up else math.floor(exact)
    return int(value or 0)


def _ready(pod: Obj) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or ()
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


class Controllers:
    """Reconciles Deployments, Jobs and pods; owns the kubelet."""

    def __init__(self, store: Store, api: Api, tick: float = 0.05) -> None:
        self.store, self.api, self.tick = store, api, tick
        self.kubelet = Kubelet(self)
        self.lock = threading.RLock()
        self._qlock = threading.Lock()
        self._dirty: dict[Key, None] = {}
        self._timers: list[tuple[float, Key]] = []
        self._progress: dict[str, tuple[int, float, bool]] = {}  # uid -> generation, since, done
        self._job_start: dict[str, float] = {}
        self._job_done: dict[str, float] = {}
        self._revisions: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        store.listeners.append(self._changed)

    # ---- queue
    def enqueue(self, key: Key) -> None:
        with self._qlock:
            self._dirty[key] = None

    def later(self, seconds: float, key: Key) -> None:
        with self._qlock:
            heapq.heappush(self._timers, (time.monotonic() + max(seconds, 0), key))

    def _changed(self, kind: str, new: Obj | None, old: Obj | None) -> None:
        obj = new if new is not None else old
        assert obj is not None
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        if new is not None and kind in ("Pod", "Deployment", "Job", "Namespace"):
            self.enqueue((kind, ns, meta["name"]))
        owner = owner_of(obj)
        if owner:
            self.enqueue((owner[0], ns, owner[1]))
        if kind in ("Secret", "ConfigMap"):
            for pod in self.store.scan("Pod", ns):
                if (pod.get("status") or {}).get("phase") == "Pending":
                    self.enqueue(("Pod", ns, pod["metadata"]["name"]))
        if new is None and kind == "Pod":
            self.kubelet.forget(obj)

    def recheck_pending(self) -> None:
        for pod in self.store.scan("Pod"):
            if (pod.get("status") or {}).get("phase") == "Pending":
                self.enqueue(("Pod", pod["metadata"]["namespace"], pod["metadata"]["name"]))

    def process(self) -> None:
        """Reconcile every queued (and every due delayed) key until the queue is empty."""
        with self.lock:
            for _ in range(10000):
                with self._qlock:
                    now = time.monotonic()
                    while self._timers and self._timers[0][0] <= now:
                        self._dirty[heapq.heappop(self._timers)[1]] = None
                    if not self._dirty:
                        return
                    key = next(iter(self._dirty))
                    del self._dirty[key]
                # ApiError: the object went away meanwhile; its next change queues it again
                with contextlib.suppress(ApiError):
                    self._reconcile(key)

    def _reconcile(self, key: Key) -> None:
        kind, ns, name = key
        obj = self.store.peek(kind, ns, name)
        if obj is None:
            return
        if kind == "Pod":
            self.kubelet.reconcile(obj)
        elif kind == "Deployment":
            self._deployment(obj)
        elif kind == "Job":
            self._job(obj)
        elif kind == "Namespace" and self.store.peek("ServiceAccount", name, "default") is None:
            sa_meta = {"name": "default", "namespace": name}
            self.store.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": sa_meta})

    # ---- background
    def start(self) -> None:
        self.kubelet.start()
        self._thread = threading.Thread(target=self._loop, name="fake-controllers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.kubelet.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.tick):
            self.recheck_pending()  # pending pods look again (images and secrets may have come)
            self.process()

    # ---- pods from templates
    def _new_pod(self, owner: Obj, template: Obj, name: str, labels: dict[str, str]) -> None:
        meta = owner["metadata"]
        tmeta = template.get("metadata") or {}
        pod_meta: Obj = {
            "name": name,
            "generateName": name[: name.rfind("-") + 1],
            "namespace": meta["namespace"],
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        }
        if tmeta.get("annotations"):
            pod_meta["annotations"] = dict(tmeta["annotations"])
        spec = clone(template.get("spec") or {})
        spec["nodeName"] = "fake-node"
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": spec}
        apply_defaults(pod, None)
        self.store.create(pod)

    # ---- Deployment
    def _deployment(self, dep: Obj) -> None:
        meta, spec = dep["metadata"], dep["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        replicas = spec.get("replicas", 1)
        template = spec.get("template") or {}
        h = template_hash(template)
        self._revision(dep, h)
        pods = [p for p in self.store.owned_by(uid) if p["kind"] == "Pod"]
        new = [p for p in pods if (p["metadata"].get("labels") or {}).get("pod-template-hash") == h]
        old = [p for p in pods if p not in new]
        labels = dict(
            (template.get("metadata") or {}).get("labels") or {}, **{"pod-template-hash": h}
        )
        for _ in range(replicas - len(new)):
            self._new_pod(dep, template, f"{name}-{h}-{suffix()}", labels)
        by_badness = sorted(new, key=lambda p: (_ready(p), p["metadata"]["name"]))
        for pod in by_badness[: max(0, len(new) - replicas)]:
            self.api.remove("Pod", ns, pod["metadata"]["name"])
        ready_new = sum(
            _ready(p)
            for p in self.store.owned_by(uid)
            if (p["metadata"].get("labels") or {}).get("pod-template-hash") == h
        )
        keep_old = max(0, replicas - ready_new)
        for pod in sorted(old, key=lambda p: (_ready(p), p["metadata"]["name"]))[
            : max(0, len(old) - keep_old)
        ]:
            self.api.remove("Pod", ns, pod["metadata"]["name"])
        self._deployment_status(dep, h)

    def _revision(self, dep: Obj, h: str) -> None:
        """The ``deployment.kubernetes.io/revision`` annotation: +1 for each new template."""
        meta = dep["metadata"]
        seen = self._revisions.setdefault(meta["uid"], {})
        if h not in seen:
            seen[h] = max(seen.values(), default=0) + 1
        rev = str(seen[h])
        if (meta.get("annotations") or {}).get(REVISION) == rev:
            return
        annotations = dict(meta.get("annotations") or {}, **{REVISION: rev})
        new = dict(dep, metadata=dict(meta, annotations=annotations))
        track_update(dep, new, "kube-controller-manager", "apps/v1")
        self.store.update(new)

    def _deployment_status(self, dep: Obj, h: str) -> None:
        meta, spec = dep["metadata"], dep["spec"]
        uid, gen, replicas = meta["uid"], meta.get("generation", 1), spec.get("replicas", 1)
        pods = [p for p in self.store.owned_by(uid) if p["kind"] == "Pod"]
        updated = [
            p for p in pods if (p["metadata"].get("labels") or {}).get("pod-template-hash") == h
        ]
        available = sum(_ready(p) for p in pods)
        rolling = (spec.get("strategy") or {}).get("rollingUpdate") or {}
        max_unavailable = _scaled(rolling.get("maxUnavailable"), replicas, up=False)
        if max_unavailable == 0 and _scaled(rolling.get("maxSurge"), replicas, up=True) == 0:
            max_unavailable = 1
        rs = f'ReplicaSet "{meta["name"]}-{h}"'
        complete = len(updated) == replicas == available and len(pods) == replicas
        now = time.monotonic()
        seen_gen, since, done = self._progress.get(uid, (0, now, False))
        if seen_gen != gen:
            since, done = now, False
        done = done or complete
        self._progress[uid] = (gen, since, done)
        deadline = spec.get("progressDeadlineSeconds", 600)
        if done:
            progressing = (
                "Progressing",
                "True",
                "NewReplicaSetAvailable",
                f"{rs} has successfully progressed.",
            )
        elif now - since > deadline:
            progressing = (
                "Progressing",
                "False",
                "ProgressDeadlineExceeded",
                f"{rs} has timed out progressing.",
            )
        else:
            self.later(
                since + deadline - now + 0.01, ("Deployment", meta["namespace"], meta["name"])
            )
            progressing = ("Progressing", "True", "ReplicaSetUpdated", f"{rs} is progressing.")
        if available >= replicas - max_unavailable:
            avail = (
                "Available",
                "True",
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.",
            )
        else:
            avail = (
                "Available",
                "False",
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
            )
        old_status = dep.get("status") or {}
        conds = conditions(old_status.get("conditions"), [avail, progressing])
        before = {c["type"]: c for c in old_status.get("conditions") or ()}
        for c in conds:
            prev = before.get(c["type"])
            same = prev and (prev.get("status"), prev.get("reason")) == (
                c["status"],
                c.get("reason"),
            )
            c["lastUpdateTime"] = prev["lastUpdateTime"] if same and prev else now_iso()
        counts = {
            "replicas": len(pods),
            "updatedReplicas": len(updated),
            "readyReplicas": available,
            "availableReplicas": available,
            "unavailableReplicas": max(0, max(replicas, len(pods)) - available),
        }
        status: Obj = {"observedGeneration": gen}
        status.update({k: v for k, v in counts.items() if v})
        status["conditions"] = conds
        if status != old_status:
            self.store.update(dict(dep, status=status))

    # ---- Job
    def _job(self, job: Obj) -> None:
        meta, spec = job["metadata"], job["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        status = clone(job.get("status") or {})
        done = _finished(job)
        if done:
            self._job_finished(job)
            return
        if spec.get("suspend"):
            return
        pods = [p for p in self.store.owned_by(uid) if p["kind"] == "Pod"]
        phases = [(p.get("status") or {}).get("phase") for p in pods]
        active = [
            p for p, ph in zip(pods, phases, strict=True) if ph not in ("Succeeded", "Failed")
        ]
        succeeded, failed = phases.count("Succeeded"), phases.count("Failed")
        completions = spec.get("completions") or 1
        now = time.monotonic()
        started = self._job_start.setdefault(uid, now)
        status.setdefault("startTime", now_iso())
        deadline = spec.get("activeDeadlineSeconds")
        finish: tuple[str, str | None, str | None] | None = None
        if succeeded >= completions:
            finish = ("Complete", None, None)
        elif failed > spec.get("backoffLimit", 6):
            finish = (
                "Failed",
                "BackoffLimitExceeded",
                "Job has reached the specified backoff limit",
            )
        elif deadline is not None and now - started >= deadline:
            finish = ("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
        elif deadline is not None:
            self.later(started + deadline - now + 0.01, ("Job", ns, name))
        if finish is None:
            want = min(spec.get("parallelism", 1), completions - succeeded)
            template = spec.get("template") or {}
            labels = dict((template.get("metadata") or {}).get("labels") or {})
            for _ in range(want - len(active)):
                self._new_pod(job, template, f"{name}-{suffix()}", labels)
            active = [
                p
                for p in self.store.owned_by(uid)
                if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            ]
        else:
            for pod in active:
                self.api.remove("Pod", ns, pod["metadata"]["name"])
            active = []
        counts = {"active": len(active), "succeeded": succeeded, "failed": failed}
        for k, v in counts.items():
            if v:
                status[k] = v
            else:
                status.pop(k, None)
        status["ready"] = sum(_ready(p) for p in active)
        status["terminating"] = 0
        status["uncountedTerminatedPods"] = {}
        if finish is not None:
            ctype, reason, message = finish
            status["conditions"] = conditions(
                status.get("conditions"), [(ctype, "True", reason, message)], probe=True
            )
            for c in status["conditions"]:
                c["lastProbeTime"] = c["lastTransitionTime"]
            if ctype == "Complete":
                status["completionTime"] = now_iso()
        if status != job.get("status"):
            job = self.store.update(dict(job, status=status))
        if finish is not None:
            self._job_finished(job)

    def _job_finished(self, job: Obj) -> None:
        meta, spec = job["metadata"], job["spec"]
        uid = meta["uid"]
        done_at = self._job_done.setdefault(uid, time.monotonic())
        owner = owner_of(job)
        if owner and owner[0] == "CronJob":
            cronjobs.job_done(self, job, owner[1])
        ttl = spec.get("ttlSecondsAfterFinished")
        if ttl is None:
            return
        left = done_at + ttl - time.monotonic()
        if left > 0:
            self.later(left + 0.01, ("Job", meta["namespace"], meta["name"]))
            return
        self._job_done.pop(uid, None)
        self._job_start.pop(uid, None)
        self.api.remove("Job", meta["namespace"], meta["name"], "Background")
