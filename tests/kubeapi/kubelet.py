"""The kubelet of the fake cluster: decides each pod's status (image pulls, secret and
config map references, crash loops, stalls), runs Job pods to completion, runs kaniko
builds (reading the build context from S3 with boto3) and keeps the pods' logs."""

from __future__ import annotations

import base64
import hashlib
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from .kaniko import (
    BUILD_LABEL,
    build_args,
    context_key,
    fetch_context,
    image_digest,
    push_oci,
    run_build,
    violations,
)
from .resources import clone, now_iso
from .runtimes import PodRuntimes

if TYPE_CHECKING:
    from .controllers import Controllers

Obj = dict[str, Any]
DEFAULT_JOB_LOG = '{"ok": true}'


def owner_of(obj: Obj) -> tuple[str, str] | None:
    for ref in obj["metadata"].get("ownerReferences") or ():
        if ref.get("controller"):
            return ref["kind"], ref["name"]
    return None


def conditions(
    old: list[Obj] | None, new: list[tuple[str, str, str | None, str | None]], probe: bool = False
) -> list[Obj]:
    """Condition dicts keeping each one's lastTransitionTime while its status holds."""
    before = {c["type"]: c for c in old or ()}
    out = []
    for ctype, status, reason, message in new:
        prev = before.get(ctype)
        cond: Obj = {"type": ctype, "status": status}
        if probe:
            cond["lastProbeTime"] = None
        same = prev is not None and prev.get("status") == status
        cond["lastTransitionTime"] = prev["lastTransitionTime"] if same and prev else now_iso()
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        out.append(cond)
    return out


class Kubelet:
    """Pod status and kaniko builds, driven by ``Controllers``."""

    def __init__(self, ctl: Controllers) -> None:
        self.ctl = ctl
        self.store = ctl.store
        self.pushed_images: set[str] = set()
        self.preloaded_images: set[str] = set()
        self.build_contexts: dict[str, list[str]] = {}
        self.layer_cache: dict[str, set[str]] = {}  # kaniko's cache repositories
        self.failing_builds: list[tuple[str, str]] = []
        self.job_logs: dict[tuple[str, str], tuple[str, bool]] = {}
        self.crashing: dict[tuple[str, str], tuple[str, int]] = {}
        self.stalled: set[tuple[str, str]] = set()
        self.logs: dict[tuple[str, str], str] = {}
        self.started: dict[str, float] = {}  # pod uid -> monotonic start
        # build pod uid -> (ok, log, termination message, init container's exit code)
        self.results: dict[str, tuple[bool, str, str, int]] = {}
        self.registry: dict[str, str] = {}  # image by tag -> the digest it names now
        # registry host -> its URL: pushes there are real (kaniko.push_oci)
        self.oci_registries: dict[str, str] = {}
        self.keep_out: set[str] = set()  # strings no build pod may hold (a storage key)
        self.violations: list[str] = []  # build pods that broke the no-credential rule
        self.runtimes = PodRuntimes()  # real servers for the pods of some Deployments
        self.job_seconds = 0.05
        self._builds: queue.Queue[tuple[str, str, str, dict[str, Any], dict[str, str]] | None] = (
            queue.Queue()
        )
        self._queued: set[str] = set()
        self._worker: threading.Thread | None = None

    # ---- lifecycle of the build worker
    def start(self) -> None:
        self._worker = threading.Thread(target=self._build_loop, name="fake-kaniko", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        self._builds.put(None)
        self.runtimes.close()

    # ---- checks
    def pullable(self, image: str) -> bool:
        return (
            image in self.pushed_images
            or image in self.preloaded_images
            or "kaniko" in image
            or image.startswith("curlimages/curl:")
        )

    def push(self, destination: str, data: bytes) -> str:
        """What a push of ``data`` as ``destination`` (a tag) does to the registry: the tag
        names the new digest, and the image is pullable by both."""
        url = self.oci_registries.get(destination.partition("/")[0])
        digest = push_oci(url, destination, data) if url else image_digest(data, destination)
        repo = destination.rsplit(":", 1)[0]
        self.registry[destination] = digest
        self.pushed_images.update({destination, f"{repo}@{digest}"})
        return digest

    def image_id(self, image: str) -> str:
        """The digest a pod of ``image`` runs: a tag resolves to what it names at pull time."""
        if "@sha256:" in image:
            return image
        digest = self.registry.get(image) or "sha256:" + hashlib.sha256(image.encode()).hexdigest()
        return f"{image.rsplit(':', 1)[0]}@{digest}"

    def _ref_error(
        self, ns: str, kind: str, name: str, key: str | None, optional: bool
    ) -> str | None:
        obj = self.store.peek(kind, ns, name)
        label = "secret" if kind == "Secret" else "configmap"
        if obj is None:
            return None if optional else f'{label} "{name}" not found'
        if key is None:
            return None
        data = (obj.get("data") or {}) | (obj.get("binaryData") or {})
        if key not in data and not optional:
            return f"couldn't find key {key} in {kind} {ns}/{name}"
        return None

    def _config_error(self, pod: Obj, c: Obj) -> str | None:
        ns = pod["metadata"]["namespace"]
        for env in c.get("env") or ():
            src = env.get("valueFrom") or {}
            for field, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                ref = src.get(field)
                if ref:
                    err = self._ref_error(
                        ns, kind, ref.get("name", ""), ref.get("key"), bool(ref.get("optional"))
                    )
                    if err:
                        return err
        for src in c.get("envFrom") or ():
            for field, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                ref = src.get(field)
                if ref:
                    err = self._ref_error(
                        ns, kind, ref.get("name", ""), None, bool(ref.get("optional"))
                    )
                    if err:
                        return err
        for vol in pod["spec"].get("volumes") or ():
            for field, kind, key in (
                ("secret", "Secret", "secretName"),
                ("configMap", "ConfigMap", "name"),
            ):
                ref = vol.get(field)
                if ref:
                    err = self._ref_error(
                        ns, kind, ref.get(key, ""), None, bool(ref.get("optional"))
                    )
                    if err:
                        return err
        return None

    def env_of(self, pod: Obj, c: Obj) -> dict[str, str]:
        """The container's environment as the kubelet resolves it (secrets decoded)."""
        ns = pod["metadata"]["namespace"]
        out: dict[str, str] = {}
        for env in c.get("env") or ():
            if "value" in env:
                out[env["name"]] = str(env["value"])
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                secret = self.store.peek("Secret", ns, ref["name"]) or {}
                raw = (secret.get("data") or {}).get(ref["key"])
                if raw is not None:
                    out[env["name"]] = base64.b64decode(raw).decode(errors="replace")
            ref = (env.get("valueFrom") or {}).get("configMapKeyRef")
            if ref:
                cm = self.store.peek("ConfigMap", ns, ref["name"]) or {}
                value = (cm.get("data") or {}).get(ref["key"])
                if value is not None:
                    out[env["name"]] = value
        return out

    def waiting_reason(
        self, pod: Obj, owner: tuple[str, str] | None
    ) -> tuple[str, str | None] | None:
        """(reason, message) a pod that has not started waits with, or None when it can run."""
        ns = pod["metadata"]["namespace"]
        if owner and owner[0] == "Deployment" and (ns, owner[1]) in self.stalled:
            return "ContainerCreating", None
        spec = pod["spec"]
        containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
        for c in containers:
            image = str(c.get("image", ""))
            if not self.pullable(image):
                return "ErrImagePull", f'failed to pull image "{image}": not found'
        for c in containers:
            err = self._config_error(pod, c)
            if err:
                return "CreateContainerConfigError", err
        return None

    # ---- pod status
    def _container_status(
        self,
        c: Obj,
        pod_uid: str,
        state: Obj,
        ready: bool,
        restarts: int = 0,
        last: Obj | None = None,
    ) -> Obj:
        image = str(c.get("image", ""))
        running = "waiting" not in state or restarts > 0
        out: Obj = {
            "name": c["name"],
            "image": image,
            "imageID": self.image_id(image) if running else "",
            "ready": ready,
            "restartCount": restarts,
            "started": "running" in state,
            "state": state,
            "lastState": last or {},
        }
        if running:
            out["containerID"] = (
                "containerd://" + hashlib.sha256((pod_uid + c["name"]).encode()).hexdigest()
            )
        return out

    def status(
        self, pod: Obj, phase: str, states: list[Obj], ready: bool, reason: str | None = None
    ) -> Obj:
        old = pod.get("status") or {}
        uid = pod["metadata"]["uid"]
        h = int(hashlib.sha256(uid.encode()).hexdigest()[:8], 16)
        unready = [s["name"] for s in states if not s["ready"]]
        why = None if ready else (reason or "ContainersNotReady")
        msg = None if ready or reason else f"containers with unready status: [{' '.join(unready)}]"
        conds = conditions(
            old.get("conditions"),
            [
                ("PodReadyToStartContainers", "True", None, None),
                ("Initialized", "True", None, None),
                ("Ready", "True" if ready else "False", why, msg),
                ("ContainersReady", "True" if ready else "False", why, msg),
                ("PodScheduled", "True", None, None),
            ],
            probe=True,
        )
        ip = f"10.244.{h % 250}.{h // 250 % 250 + 1}"
        return {
            "phase": phase,
            "conditions": conds,
            "hostIP": "172.18.0.2",
            "hostIPs": [{"ip": "172.18.0.2"}],
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": old.get("startTime") or now_iso(),
            "containerStatuses": states,
            "qosClass": old.get("qosClass", "BestEffort"),
        }

    def _write(self, pod: Obj, status: Obj) -> None:
        if status != pod.get("status"):
            self.store.update(dict(pod, status=status))

    def reconcile(self, pod: Obj) -> None:
        """Move one pod along: Pending -> Running (-> Succeeded / Failed for Job pods)."""
        status = pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            return
        meta = pod["metadata"]
        ns, uid = meta["namespace"], meta["uid"]
        owner = owner_of(pod)
        containers = pod["spec"].get("containers") or []
        if status.get("phase") != "Running":
            waiting = self.waiting_reason(pod, owner)
            if waiting:
                state = {
                    "waiting": {"reason": waiting[0]}
                    | ({"message": waiting[1]} if waiting[1] else {})
                }
                states = [self._container_status(c, uid, clone(state), False) for c in containers]
                self._write(pod, self.status(pod, "Pending", states, False))
                return
        now = now_iso()
        running = [{"running": {"startedAt": now}} for _ in containers]
        for i, s in enumerate(status.get("containerStatuses") or ()):
            if i < len(running) and "running" in (s.get("state") or {}):
                running[i] = s["state"]
        self.started.setdefault(uid, time.monotonic())
        if owner and owner[0] == "Job":
            self._job_pod(pod, owner[1], running)
            return
        crash = self._crashing(ns, owner[1]) if owner and owner[0] == "Deployment" else None
        if crash:
            self._crash(pod, crash)
            return
        if owner and owner[0] == "Deployment" and containers:
            self.runtimes.start(pod, owner[1], self.env_of(pod, containers[0]))
        states = [
            self._container_status(c, uid, running[i], True) for i, c in enumerate(containers)
        ]
        self._write(pod, self.status(pod, "Running", states, True))

    def _crashing(self, ns: str, deployment: str) -> tuple[str, int] | None:
        """How the pods of ``deployment`` crash: set for its name, or for a prefix of it
        (``name*``: a Deployment whose whole name a test cannot know beforehand)."""
        found = self.crashing.get((ns, deployment))
        if found is not None:
            return found
        for (where, name), crash in self.crashing.items():
            if where == ns and name.endswith("*") and deployment.startswith(name[:-1]):
                return crash
        return None

    def _crash(self, pod: Obj, crash: tuple[str, int]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        elapsed = time.monotonic() - self.started[uid]
        restarts = min(1 + int(elapsed / 5), 5)
        if restarts < 5:
            self.ctl.later(5 - elapsed % 5, ("Pod", meta["namespace"], meta["name"]))
        states = []
        for c in pod["spec"].get("containers") or []:
            pod_ref = f"{meta['name']}_{meta['namespace']}({uid})"
            msg = f"back-off 10s restarting failed container={c['name']} pod={pod_ref}"
            last = {
                "terminated": {
                    "exitCode": crash[1],
                    "reason": crash[0],
                    "startedAt": meta["creationTimestamp"],
                    "finishedAt": meta["creationTimestamp"],
                }
            }
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": msg}}
            states.append(self._container_status(c, uid, state, False, restarts, last))
        self._write(pod, self.status(pod, "Running", states, False))

    def _job_pod(self, pod: Obj, job: str, running: list[Obj]) -> None:
        meta = pod["metadata"]
        ns, uid = meta["namespace"], meta["uid"]
        containers = pod["spec"].get("containers") or []
        build = build_args(pod)
        result: tuple[bool, str] | None = None
        if build is not None:
            result = self.results.get(uid)
            if result is None and uid not in self._queued:
                self._queued.add(uid)
                env = self.env_of(pod, build["container"])
                self._builds.put((ns, meta["name"], uid, build | {"pod": clone(pod)}, env))
        else:
            left = self.started[uid] + self.job_seconds - time.monotonic()
            if left <= 0:
                log, ok = self.job_logs.get((ns, job), (DEFAULT_JOB_LOG, True))
                result = (ok, log)
            else:
                self.ctl.later(left, ("Pod", ns, meta["name"]))
        if result is None:
            states = [
                self._container_status(c, uid, running[i], True) for i, c in enumerate(containers)
            ]
            self._write(pod, self.status(pod, "Running", states, True))
            return
        ok, log = result[0], result[1]
        message, init_exit = (result[2], result[3]) if len(result) > 2 else ("", 0)
        self.logs[(ns, meta["name"])] = log
        started = running[0]["running"]["startedAt"] if running else now_iso()
        term = {
            "exitCode": 0 if ok else 1,
            "reason": "Completed" if ok else "Error",
            "startedAt": started,
            "finishedAt": now_iso(),
        }
        if message:
            term["message"] = message
        if init_exit:  # the init container failed: the main one never ran
            states = [
                self._container_status(c, uid, {"waiting": {"reason": "PodInitializing"}}, False)
                for c in containers
            ]
        else:
            states = [
                self._container_status(c, uid, {"terminated": dict(term)}, False)
                for c in containers
            ]
        phase = "Succeeded" if ok else "Failed"
        status = self.status(pod, phase, states, False, "PodCompleted" if ok else "PodFailed")
        inits = pod["spec"].get("initContainers") or []
        if inits:
            done = {"exitCode": init_exit, "reason": "Error" if init_exit else "Completed"}
            done |= {"startedAt": started, "finishedAt": started}
            status["initContainerStatuses"] = [
                self._container_status(c, uid, {"terminated": dict(done)}, False) for c in inits
            ]
        self._write(pod, status)

    def _kaniko(self, build: dict[str, Any], env: dict[str, str]) -> tuple[bool, str, str, int]:
        """(ok, log, termination message, init exit code) of one build pod."""
        pod = build["pod"]
        if BUILD_LABEL in (pod["metadata"].get("labels") or {}):
            broken = violations(pod, self.keep_out)
            if broken:
                self.violations.extend(f"{pod['metadata']['name']}: {b}" for b in broken)
                return False, "policy: a build pod holds a storage credential", "", 0
        fetched = None
        if build["context"].startswith("tar://"):
            path = build["context"][len("tar://") :]
            data, code, why = fetch_context(pod, path)
            if data is None:
                return False, why, "", code
            fetched = (context_key(pod), data)
        ok, log = run_build(
            build, env, self.failing_builds, self.build_contexts, self.layer_cache, fetched
        )
        if not ok:
            return False, log, "", 0
        content = fetched[1] if fetched else log.encode()
        digests = [self.push(dest, content) for dest in build["destinations"]]
        to_log = build.get("digest_file") == "/dev/termination-log" and digests
        return True, log, digests[0] if to_log else "", 0

    def forget(self, pod: Obj) -> None:
        """A pod is gone: so are its log and the kubelet's memory of it."""
        meta = pod["metadata"]
        self.logs.pop((meta.get("namespace", ""), meta["name"]), None)
        self.started.pop(meta["uid"], None)
        self.results.pop(meta["uid"], None)
        self._queued.discard(meta["uid"])
        self.runtimes.stop(meta["uid"])

    # ---- kaniko
    def _build_loop(self) -> None:
        while True:
            item = self._builds.get()
            if item is None:
                return
            ns, name, uid, build, env = item
            try:
                result = self._kaniko(build, env)
            except Exception as exc:  # a build must never kill the worker
                result = (False, f"error building image: {exc}", "", 0)
            self.results[uid] = result
            if result[0]:
                self.ctl.recheck_pending()
            self.ctl.enqueue(("Pod", ns, name))
            self.ctl.process()
