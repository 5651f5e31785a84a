"""``FakeKube``: the fake Kubernetes API server as a Python object (start/stop, kubeconfig,
inspection and fault-injection hooks, also served as JSON under ``/_test/``)."""

from __future__ import annotations

import json
import ssl
import sys
import threading
from collections import Counter
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from . import cronjobs
from .controllers import Controllers
from .ops import Api
from .patches import APPLY
from .resources import BY_KIND, ApiError, bad_request, clone, not_found
from .server import Handler
from .store import Store
from .tls import ServerTLS

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
MESSAGES = {
    409: "Operation cannot be fulfilled on {kind}: the object has been modified; please apply "
    "your changes to the latest version and try again",
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: injected failure",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted",
}
SYSTEM_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    fake: FakeKube

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):
            return  # a client that gave up on the handshake is the client's business
        super().handle_error(request, client_address)


class FakeKube:
    """A strict in-process double of the Kubernetes REST API (see the package docs)."""

    def __init__(
        self,
        token: str = "test-token",
        host: str = "127.0.0.1",
        port: int = 0,
        tick: float = 0.05,
        tls: bool = False,
    ) -> None:
        """``tls``: serve HTTPS with a CA of its own (``kubectl`` needs it, see ``tls``)."""
        self.token = token
        # when set, decides alone which Authorization headers are taken (expiring tokens)
        self.authenticate: Callable[[str | None], bool] | None = None
        self.tls = ServerTLS() if tls else None
        self.store = Store()
        self.api = Api(self.store)
        self.controllers = Controllers(self.store, self.api, tick)
        self.kubelet = self.controllers.kubelet
        self.kubeconfig: Path | None = None
        self._address = (host, port)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._writes: Counter[tuple[str, str]] = Counter()
        self._injections: list[dict[str, Any]] = []
        # when set (benchmarks), called as things happen, from the thread serving them:
        # ("watch", {"type", "object"}) as an event is about to be written to a watch stream,
        # ("proxy", {"namespace", "service", "method", "path"}) as services/proxy takes a call
        self.trace: Callable[[str, dict[str, Any]], None] | None = None
        for ns in SYSTEM_NAMESPACES:
            body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            self.api.create(BY_KIND["Namespace"], "", body, "kube-apiserver")
        self.controllers.process()

    def accepts(self, authorization: str | None) -> bool:
        if self.authenticate is not None:
            return self.authenticate(authorization)
        return authorization == f"Bearer {self.token}"

    # ---- lifecycle
    def start(self) -> FakeKube:
        self._server = _Server(self._address, Handler)
        self._server.fake = self
        if self.tls is not None:
            self._server.socket = self.tls.wrap(self._server.socket)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fake-kube", daemon=True
        )
        self._thread.start()
        self.controllers.start()
        return self

    def stop(self) -> None:
        with self.store.lock:
            self.store.closed = True
            self.store.changed.notify_all()
        self.controllers.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeKube is not started")
        host, port = self._server.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        """A kubeconfig whose current context reaches this server with the bearer token."""
        cluster: dict[str, Any] = {"server": self.url}
        if self.tls is not None:
            cluster.update(self.tls.cluster_fields())
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": cluster}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
            "current-context": "fake",
            "preferences": {},
        }
        path = Path(path)
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        return path

    # ---- counting and injected failures
    def count_request(self, verb: str, kind: str) -> ApiError | None:
        """Count one request; the injected error it is to get, if any."""
        with self._lock:
            self._requests[(verb, kind)] += 1
            for inj in self._injections:
                if inj["verb"] in (verb, "*") and inj["kind"] in (kind, "*"):
                    inj["times"] -= 1
                    if inj["times"] <= 0:
                        self._injections.remove(inj)
                    base = kind.split("/")[0]
                    plural = (
                        self.store.kinds.res(base).qualified
                        if base in BY_KIND or base in self.store.kinds.custom
                        else kind
                    )
                    return _injected(inj, plural)
        return None

    def count_write(self, verb: str, kind: str) -> None:
        with self._lock:
            self._writes[(verb, kind)] += 1

    def counts(self) -> dict[str, dict[tuple[str, str], int]]:
        """``{"requests": {(verb, Kind): n}, "writes": {(verb, Kind): n}}``."""
        with self._lock:
            return {"requests": dict(self._requests), "writes": dict(self._writes)}

    def reset_counts(self) -> None:
        with self._lock:
            self._requests.clear()
            self._writes.clear()

    def inject(
        self, verb: str, kind: str, status: int, times: int = 1, retry_after: int | None = None
    ) -> None:
        """The next ``times`` requests (verb, Kind; ``*`` matches any) get ``status``."""
        with self._lock:
            self._injections.append(
                {
                    "verb": verb,
                    "kind": kind,
                    "status": int(status),
                    "times": int(times),
                    "retry_after": retry_after,
                }
            )

    # ---- custom resources
    def install_crd(self, crd: dict[str, Any] | str | Path) -> dict[str, Any]:
        """Create or replace a CustomResourceDefinition (a dict, a YAML file's path, or YAML
        text) by server-side apply (manager ``kubectl``, forced); it is established at once,
        its kind served. The stored CRD (``POST /_test/crd`` with the CRD as JSON, too)."""
        text = isinstance(crd, str) and ("\n" in crd or crd.lstrip().startswith("{"))
        if isinstance(crd, Path) or (isinstance(crd, str) and not text):
            crd = Path(crd).read_text(encoding="utf-8")
        body = yaml.safe_load(crd) if isinstance(crd, str) else crd
        raw = json.dumps(body).encode()
        res, name = BY_KIND["CustomResourceDefinition"], body["metadata"]["name"]
        self.api.begin(None)
        _, out = self.api.patch(res, "", name, raw, APPLY, "kubectl", force=True)
        self.controllers.process()
        return clone(out)

    # ---- inspection
    def objects(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.list(kind, namespace)[0]

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.store.get(kind, namespace or "", name)

    @property
    def pushed_images(self) -> set[str]:
        return self.kubelet.pushed_images

    @property
    def preloaded_images(self) -> set[str]:
        return self.kubelet.preloaded_images

    @preloaded_images.setter
    def preloaded_images(self, images: set[str]) -> None:
        self.kubelet.preloaded_images = set(images)
        self._kick_pods()

    @property
    def job_seconds(self) -> float:
        """How long a (non-build) Job pod runs before it ends; 0.05 s by default."""
        return self.kubelet.job_seconds

    @job_seconds.setter
    def job_seconds(self, seconds: float) -> None:
        self.kubelet.job_seconds = seconds

    @property
    def build_contexts(self) -> dict[str, list[str]]:
        return self.kubelet.build_contexts

    @property
    def build_violations(self) -> list[str]:
        """Build pods that held a storage credential (see kaniko.violations)."""
        return self.kubelet.violations

    def keep_out_of_builds(self, *secrets: str) -> None:
        """Strings (a storage key) whose presence anywhere in a build pod fails the build."""
        self.kubelet.keep_out.update(secrets)

    def push_image(self, destination: str, data: bytes) -> str:
        """Push ``data`` as ``destination`` past any build (someone holding a push
        credential); the digest the tag now names."""
        return self.kubelet.push(destination, data)

    def registry_digest(self, destination: str) -> str | None:
        return self.kubelet.registry.get(destination)

    # ---- behaviour of the cluster
    def set_job_log(self, namespace: str, job_name: str, log: str, succeed: bool = True) -> None:
        self.kubelet.job_logs[(namespace, job_name)] = (log, succeed)

    def fail_build(self, tag_substring: str, log: str) -> None:
        self.kubelet.failing_builds.append((tag_substring, log))

    def fire_cronjob(self, namespace: str, name: str) -> dict[str, Any]:
        return cronjobs.fire(self.controllers, namespace, name)

    def crash_loop(
        self, namespace: str, deployment: str, reason: str = "Error", exit_code: int = 1
    ) -> None:
        self.kubelet.crashing[(namespace, deployment)] = (reason, exit_code)
        self._kick_pods()

    def run_runtime(
        self, namespace: str, deployment: str, folder: str | Path, runtime: str = "python3.11"
    ) -> None:
        """The pods of ``deployment`` run a real runtime server, with the function's code
        from ``folder`` (see ``runtimes``); the pod proxy reaches it."""
        self.kubelet.runtimes.serve(namespace, deployment, Path(folder), runtime)
        self._kick_pods()

    def stall(self, namespace: str, deployment: str) -> None:
        self.kubelet.stalled.add((namespace, deployment))

    def heal(self, namespace: str, deployment: str) -> None:
        """Undo ``crash_loop`` and ``stall`` for a Deployment."""
        self.kubelet.crashing.pop((namespace, deployment), None)
        self.kubelet.stalled.discard((namespace, deployment))
        self._kick_pods()

    def _kick_pods(self) -> None:
        for pod in self.store.scan("Pod"):
            self.controllers.enqueue(("Pod", pod["metadata"]["namespace"], pod["metadata"]["name"]))
        self.controllers.process()

    def pod_log(self, namespace: str, name: str, query: dict[str, str]) -> str:
        """The text ``GET .../pods/{name}/log`` answers (``ApiError`` like the real server)."""
        pod = self.store.peek("Pod", namespace, name)
        if pod is None:
            raise not_found(BY_KIND["Pod"], name)
        spec = pod["spec"]
        names = [c["name"] for c in spec.get("containers") or ()]
        container = query.get("container")
        if not container:
            if len(names) > 1:
                choices = " ".join(names)
                raise bad_request(
                    f"a container name must be specified for pod {name}, choose one of: [{choices}]"
                )
            container = names[0]
        elif container not in names + [c["name"] for c in spec.get("initContainers") or ()]:
            raise bad_request(f"container {container} is not valid for pod {name}")
        statuses = {s["name"]: s for s in (pod.get("status") or {}).get("containerStatuses") or ()}
        status = statuses.get(container) or {
            "state": {"waiting": {"reason": "ContainerCreating"}},
            "restartCount": 0,
        }
        waiting = (status.get("state") or {}).get("waiting")
        if waiting and not status.get("restartCount"):
            why = waiting.get("reason", "ContainerCreating")
            if why in ("ErrImagePull", "ImagePullBackOff"):
                why = "trying and failing to pull image"
            raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: {why}')
        log = self.kubelet.runtimes.log(pod["metadata"]["uid"])  # a pod that runs a runtime
        if log is None:
            log = self.kubelet.logs.get((namespace, name), "")
        if query.get("tailLines", "").isdigit():
            n = int(query["tailLines"])
            log = "".join(log.splitlines(keepends=True)[-n:]) if n else ""
        if query.get("limitBytes", "").isdigit():
            log = log[: int(query["limitBytes"])]
        return log

    # ---- /_test over HTTP
    def test_hook(
        self, method: str, path: str, query: dict[str, str], raw: bytes
    ) -> tuple[int, Any]:
        body = json.loads(raw) if raw else {}
        hook = path[len("/_test/") :]
        if method == "GET" and hook == "counts":
            counts = self.counts()
            return 200, {
                k: {f"{v} {kind}": n for (v, kind), n in d.items()} for k, d in counts.items()
            }
        if method == "GET" and hook == "objects":
            return 200, self.objects(query["kind"], query.get("namespace") or None)
        if method == "GET" and hook == "object":
            obj = self.get(query["kind"], query.get("namespace"), query["name"])
            return (200, obj) if obj is not None else (404, None)
        if method == "POST" and hook == "crd":
            return 200, self.install_crd(body)
        if method == "GET" and hook == "images":
            return 200, {
                "pushed": sorted(self.pushed_images),
                "preloaded": sorted(self.preloaded_images),
                "build_contexts": self.build_contexts,
            }
        actions = {
            "reset": lambda: self.reset_counts(),
            "inject": lambda: self.inject(
                body["verb"],
                body["kind"],
                body["status"],
                body.get("times", 1),
                body.get("retry_after"),
            ),
            "job-log": lambda: self.set_job_log(
                body["namespace"],
                body.get("job_name") or body["job"],
                body["log"],
                body.get("succeed", True),
            ),
            "fail-build": lambda: self.fail_build(body["tag_substring"], body["log"]),
            "fire-cronjob": lambda: self.fire_cronjob(body["namespace"], body["name"]),
            "preload": lambda: setattr(
                self, "preloaded_images", self.preloaded_images | set(body["images"])
            ),
            "crash-loop": lambda: self.crash_loop(
                body["namespace"],
                body["deployment"],
                body.get("reason", "Error"),
                body.get("exit_code", 1),
            ),
            "stall": lambda: self.stall(body["namespace"], body["deployment"]),
            "heal": lambda: self.heal(body["namespace"], body["deployment"]),
        }
        if method != "POST" or hook not in actions:
            return 404, {"error": f"no test hook {method} {path}"}
        try:
            result = actions[hook]()
        except KeyError as exc:
            raise bad_request(f"{path}: missing field {exc}") from exc
        return 200, result if result is not None else {}


def _injected(inj: dict[str, Any], plural: str) -> ApiError:
    code = inj["status"]
    message = MESSAGES.get(code, f"injected failure {code}").format(kind=plural)
    details: dict[str, Any] = {}
    headers = {}
    if inj["retry_after"] is not None:
        details["retryAfterSeconds"] = int(inj["retry_after"])
        headers["Retry-After"] = str(inj["retry_after"])
    return ApiError(code, REASONS.get(code, "Unknown"), message, details, headers)
