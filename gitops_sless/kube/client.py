"""The Kubernetes API, as this backend uses it: a few verbs on a few kinds, with retries.

Requests go through the official client's ``ApiClient`` (its configuration,
authentication and TLS), but bodies stay plain JSON dicts: the backend reads
and writes the same dicts the renderer produces, and a LIST of a thousand
objects is never turned into a thousand model instances.

Errors are typed by what happens next: 409 Conflict, 429 and 5xx are retried
with backoff (honouring ``Retry-After``) and end as :class:`KubeUnavailable`;
404 is :class:`NotFound`; 409 AlreadyExists is :class:`AlreadyExists`; 422 is
:class:`Invalid` with the API server's message; 401/403 is :class:`Forbidden`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from ..errors import PermanentError, TransientError
from .credentials import Credentials
from .kinds import KINDS, kind_of

# a generator of its own: the global one stays the caller's (seeded tests, hypothesis)
_random = random.Random()

__all__ = [
    "AUTOSCALER",
    "FIELD_MANAGER",
    "AlreadyExists",
    "Expired",
    "Forbidden",
    "Invalid",
    "KubeClient",
    "KubeUnavailable",
    "NotFound",
    "NotLeader",
    "Unauthorized",
    "kind_of",
]

log = logging.getLogger(__name__)

FIELD_MANAGER = "gitops-sless"
# the field manager of the replicas the autoscaler writes (the scale subresource): its own,
# so that the apply of a Deployment, which leaves them out, never takes them back
AUTOSCALER = "gitops-sless-autoscaler"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


# Every call this package makes, by kind: the client refuses any other, so this table is
# exactly what the reconciler does to a cluster, and deploy/'s ClusterRole is derived from
# it (tests/test_deploy.py). "apply" is a server-side apply (RBAC: create and patch), "log"
# reads pods/log, "status" writes the status subresource (RBAC: patch), "scale" reads and
# writes the scale subresource (RBAC: get and patch on deployments/scale). Kinds in
# OWN_NAMESPACE_ONLY are used only in the reconciler's own namespace (a Role there, not the
# ClusterRole).
CALLS: dict[str, frozenset[str]] = {
    kind: frozenset(verbs.split())
    for kind, verbs in {
        "Namespace": "get list watch apply delete",
        "Secret": "get apply",
        # build records; delete: garbage collection
        "ConfigMap": "list watch create delete",
        "Service": "list watch apply delete",
        # watch: the build pods (kube/builds.py); proxy: a runtime's /health (its load)
        "Pod": "list watch log proxy",
        # scale: the autoscaler's replicas, and a wake from zero by any replica
        "Deployment": "list watch apply delete scale",
        "Job": "get list watch create patch delete",
        "CronJob": "list watch apply delete",
        "NetworkPolicy": "list watch apply",  # gone with their namespace, never deleted alone
        "Lease": "get list create update delete",  # delete, list: membership (kube/members.py)
        "Function": "list watch apply delete status",
        "HTTPRoute": "list watch apply delete",  # --gateway: one per http function
        "Gateway": "get",  # --gateway: its address is the functions' public URL
        "ReferenceGrant": "list apply delete",  # --gateway: one per environment (activator)
    }.items()
}
OWN_NAMESPACE_ONLY = frozenset({"Lease", "ConfigMap", "ReferenceGrant"})


class KubeError(Exception):
    """What the API server said, for the messages below."""

    status: int = 0


class NotFound(KubeError, PermanentError):
    status = 404


class AlreadyExists(KubeError, PermanentError):
    status = 409


class Invalid(KubeError, PermanentError):
    """422: the object is malformed; the same object is refused again."""

    status = 422


class Forbidden(KubeError, PermanentError):
    """401/403: the credentials are wrong or lack a permission (RBAC)."""


class Unauthorized(Forbidden):
    """401: the server does not take the credentials (any more): they are loaded again once."""

    status = 401


class KubeUnavailable(KubeError, TransientError):
    """The API server could not be reached, or kept answering 409/429/5xx."""


class Expired(KubeError, TransientError):
    """410 Gone: the resourceVersion a watch asked for is older than the server's history."""

    status = 410


class NotLeader(KubeError, TransientError):
    """A write was about to be made by a replica that does not hold the lease."""


WRITES = frozenset({"apply", "create", "patch", "delete", "update", "status"})


def _message(status: int, body: bytes) -> tuple[str, str]:
    try:
        payload = json.loads(body)
        return str(payload.get("reason") or ""), str(payload.get("message") or "")
    except (ValueError, AttributeError):
        return "", body.decode("utf-8", "replace")[:300]


class KubeClient:
    """JSON verbs on the kinds of :data:`KINDS`, through one ``kubernetes.client.ApiClient``."""

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        in_cluster: bool = False,
        attempts: int = 6,
        backoff_sec: float = 0.2,
        max_wait_sec: float = 10.0,
        timeout_sec: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        calls: Mapping[str, frozenset[str]] | None = CALLS,
        credentials: Credentials | None = None,
    ) -> None:
        """``calls``: the calls allowed (None: any, for tests that set a cluster up);
        ``credentials``: the Authorization header (default: the configuration's, as it is)."""
        self.api = api
        self.credentials = credentials or Credentials(api.configuration)
        self.calls = calls
        # asked before every write: a replica that is not the leader (any more) writes nothing
        self.may_write: Callable[[], bool] = lambda: True
        self.own_namespace: str | None = None  # set once known: see OWN_NAMESPACE_ONLY
        self.in_cluster = in_cluster
        self.attempts = attempts
        self.backoff_sec = backoff_sec
        self.max_wait_sec = max_wait_sec
        self.timeout_sec = timeout_sec
        self._sleep = sleep
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()  # (verb, kind) -> count
        self._watches: k8s.rest.RESTClientObject | None = None

    @classmethod
    def from_config(
        cls,
        kubeconfig: str | None = None,
        context: str | None = None,
        calls: Mapping[str, frozenset[str]] | None = CALLS,
    ) -> KubeClient:
        """In a pod without a kubeconfig: the service account; else the kubeconfig file."""
        configuration = k8s.Configuration()
        in_cluster = not kubeconfig and "KUBERNETES_SERVICE_HOST" in os.environ

        def load(configuration: k8s.Configuration) -> None:
            if in_cluster:
                k8s_config.load_incluster_config(client_configuration=configuration)
            else:
                k8s_config.load_kube_config(
                    config_file=kubeconfig, context=context, client_configuration=configuration
                )

        try:
            load(configuration)
        except (ConfigException, OSError, ValueError, TypeError) as exc:
            where = "in-cluster service account" if in_cluster else (kubeconfig or "~/.kube/config")
            raise Forbidden(f"cannot load Kubernetes credentials from {where}: {exc}") from exc
        configuration.retries = False  # retries are ours: with backoff, typed errors, counted
        configuration.connection_pool_maxsize = 32  # the reconciler's workers share it
        # asked per request, and loaded again on a 401: exec plugins issue expiring tokens
        credentials = Credentials(configuration, load)
        return cls(
            k8s.ApiClient(configuration),
            in_cluster=in_cluster,
            calls=calls,
            credentials=credentials,
        )

    @property
    def host(self) -> str:
        return str(self.api.configuration.host)

    # --- raw ---------------------------------------------------------------------------

    def request(
        self,
        verb: str,
        kind: str,
        method: str,
        path: str,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        *,
        guarded: bool = True,
        attempts: int | None = None,
    ) -> bytes:
        """One call, retried while the answer is transient; the response body."""
        if guarded and verb in WRITES and not self.may_write():
            raise NotLeader(f"{verb} {kind}: this replica does not hold the lease")
        elsewhere = self.own_namespace and f"/namespaces/{self.own_namespace}/" not in path
        if self.calls is not None and kind in OWN_NAMESPACE_ONLY and elsewhere:
            raise Forbidden(f"{verb} {kind}: only in the namespace {self.own_namespace}")
        if self.calls is not None and kind != "Version" and verb not in self.calls.get(kind, ()):
            raise Forbidden(
                f"{verb} {kind}: not a call this reconciler makes (kube/client.py CALLS)"
            )
        url = self.host + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json", "Content-Type": content_type}
        attempts = attempts or self.attempts
        authorization = self.credentials.header()
        try:
            return self._send(verb, kind, method, path, url, headers, body, attempts, authorization)
        except Unauthorized:
            renewed = self.credentials.renew(authorization)
            if renewed == authorization:
                raise
            return self._send(verb, kind, method, path, url, headers, body, attempts, renewed)

    def _send(
        self,
        verb: str,
        kind: str,
        method: str,
        path: str,
        url: str,
        headers: dict[str, str],
        body: Any,
        attempts: int,
        authorization: str | None,
    ) -> bytes:
        if authorization:
            headers = {**headers, "Authorization": authorization}
        for attempt in range(1, attempts + 1):
            with self._lock:
                self.requests[(verb, kind)] += 1
            try:
                response = self.api.call_api(
                    method,
                    url,
                    header_params=dict(headers),
                    body=body,
                    _request_timeout=self.timeout_sec,
                )
                response.read()
                status, payload = response.status, response.data
                retry_after = response.getheader("Retry-After")
            except ApiException as exc:
                status, payload = exc.status or 0, (exc.body or b"")
                retry_after = (exc.headers or {}).get("Retry-After")
                if isinstance(payload, str):
                    payload = payload.encode()
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                if attempt == attempts:
                    raise KubeUnavailable(f"Kubernetes API at {self.host}: {_reason(exc)}") from exc
                self._sleep(self._delay(attempt, None))
                continue
            if 200 <= status < 300:
                return payload or b""
            reason, message = _message(status, payload or b"")
            if status == 409 and reason == "AlreadyExists":
                raise AlreadyExists(message)
            retryable = status in (409, 429) or status >= 500
            if retryable and attempt < attempts:
                log.debug("%s %s: %d %s; retrying", method, path, status, reason)
                self._sleep(self._delay(attempt, retry_after))
                continue
            raise _error(status, reason, message or f"{method} {path}: HTTP {status}")
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(float(retry_after), self.max_wait_sec)
            except ValueError:
                pass
        return min(self.backoff_sec * 2 ** (attempt - 1), self.max_wait_sec) * (
            0.5 + _random.random() / 2
        )

    def _json(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.request(*args, **kwargs) or b"{}")
        return result

    # --- verbs -------------------------------------------------------------------------

    def version(self) -> dict[str, Any]:
        return self._json("get", "Version", "GET", "/version")

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._json("get", kind, "GET", KINDS[kind].path(namespace, name))
        except NotFound:
            return None

    def list(
        self, kind: str, namespace: str | None, selector: Mapping[str, str] | str | None = None
    ) -> list[dict[str, Any]]:
        """Every object of ``kind`` in ``namespace`` (None: every namespace) matching the labels."""
        return self.list_versioned(kind, namespace, selector)[0]

    def list_versioned(
        self, kind: str, namespace: str | None, selector: Mapping[str, str] | str | None = None
    ) -> tuple[list[dict[str, Any]], str]:
        """:meth:`list`, and the list's ``resourceVersion``: where a watch of it starts."""
        query = {"labelSelector": _selector(selector)} if selector else {}
        try:
            body = self._json("list", kind, "GET", KINDS[kind].path(namespace), query)
        except NotFound:
            return [], ""  # the namespace is not there (yet): nothing in it
        items: list[dict[str, Any]] = body.get("items") or []
        for item in items:  # list items come without kind and apiVersion
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", KINDS[kind].api_version)
        return items, str((body.get("metadata") or {}).get("resourceVersion") or "")

    def watch(
        self,
        kind: str,
        namespace: str | None,
        selector: Mapping[str, str] | str | None,
        resource_version: str,
        timeout_sec: float,
    ) -> Iterator[dict[str, Any]]:
        """The events of a WATCH from ``resource_version`` (bookmarks asked for), until the
        server ends it after ``timeout_sec``. A 410 (an ``ERROR`` event or the answer) raises
        :class:`Expired`; a cut stream or an unreachable server, :class:`KubeUnavailable`."""
        if self.calls is not None and "watch" not in self.calls.get(kind, ()):
            raise Forbidden(
                f"watch {kind}: not a call this reconciler makes (kube/client.py CALLS)"
            )
        query = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(int(timeout_sec)),
        }
        if selector:
            query["labelSelector"] = _selector(selector)
        path = KINDS[kind].path(namespace)
        headers = {"Accept": "application/json"}
        authorization = self.credentials.header()
        if authorization:
            headers["Authorization"] = authorization
        with self._lock:
            self.requests[("watch", kind)] += 1
        try:
            # the read timeout outlasts the server's own end of the stream, bookmarks included
            response = self._watch_pool().request(
                "GET",
                f"{self.host}{path}?{urlencode(query)}",
                headers=headers,
                preload_content=False,
                timeout=urllib3.Timeout(connect=self.timeout_sec, read=timeout_sec + 30),
            )
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnavailable(f"watch {kind} at {self.host}: {_reason(exc)}") from exc
        try:
            if response.status != 200:
                reason, message = _message(response.status, response.data or b"")
                if response.status == 410:
                    raise Expired(message or "410 Gone")
                if (
                    response.status == 401
                    and self.credentials.renew(authorization) != authorization
                ):
                    raise KubeUnavailable(f"watch {kind}: the token was refused; renewed")
                raise _error(response.status, reason, message or f"watch {path}: {response.status}")
            yield from _events(response, kind)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnavailable(f"watch {kind} cut: {_reason(exc)}") from exc
        finally:
            response.release_conn()

    def _watch_pool(self) -> urllib3.PoolManager:
        """Watches hold a connection each for minutes: their own pool, so they never starve
        the requests of a pass (and the pool is as big as the watches)."""
        with self._lock:
            if self._watches is None:
                self._watches = k8s.rest.RESTClientObject(_watch_configuration(self.api))
            return self._watches.pool_manager

    def apply(self, obj: Mapping[str, Any], force: bool = True) -> dict[str, Any]:
        """Server-side apply of ``obj`` as the ``gitops-sless`` field manager."""
        kind, meta = KINDS[obj["kind"]], obj["metadata"]
        query = {"fieldManager": FIELD_MANAGER, "force": "true" if force else "false"}
        path = kind.path(meta.get("namespace"), meta["name"])
        return self._json(
            "apply", kind.name, "PATCH", path, query, dict(obj), "application/apply-patch+yaml"
        )

    def apply_status(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of ``obj``'s status, through the status subresource."""
        kind, meta = KINDS[obj["kind"]], obj["metadata"]
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        path = kind.path(meta.get("namespace"), meta["name"]) + "/status"
        return self._json(
            "status", kind.name, "PATCH", path, query, dict(obj), "application/apply-patch+yaml"
        )

    def read_scale(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The ``Scale`` (autoscaling/v1) of an object; None when the object is not there."""
        path = KINDS[kind].path(namespace, name) + "/scale"
        try:
            return self._json("scale", kind, "GET", path)
        except NotFound:
            return None

    def scale(self, kind: str, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """``spec.replicas`` written through the scale subresource, as :data:`AUTOSCALER`;
        the ``Scale`` answered. Never guarded: any replica may wake a function at zero (the
        autoscaler's own decisions are written by the leader only)."""
        path = KINDS[kind].path(namespace, name) + "/scale"
        return self._json(
            "scale",
            kind,
            "PATCH",
            path,
            {"fieldManager": AUTOSCALER},
            {"spec": {"replicas": replicas}},
            "application/merge-patch+json",
            guarded=False,
        )

    def create(self, obj: Mapping[str, Any], guarded: bool = True) -> dict[str, Any]:
        kind, meta = KINDS[obj["kind"]], obj["metadata"]
        query = {"fieldManager": FIELD_MANAGER}
        path = kind.path(meta.get("namespace"))
        return self._json("create", kind.name, "POST", path, query, obj, guarded=guarded)

    def update(self, obj: Mapping[str, Any], attempts: int | None = None) -> dict[str, Any]:
        """PUT with the object's ``resourceVersion``: 409 when someone wrote it since.

        Never guarded: the lease is written by replicas that do not lead (yet).
        """
        kind, meta = KINDS[obj["kind"]], obj["metadata"]
        path = kind.path(meta.get("namespace"), meta["name"])
        query = {"fieldManager": FIELD_MANAGER}
        return self._json(
            "update", kind.name, "PUT", path, query, obj, guarded=False, attempts=attempts
        )

    def patch(
        self, kind: str, namespace: str | None, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """A JSON merge patch, under its own field manager (records written onto objects,
        which a later apply by ``gitops-sless`` must not take back)."""
        query = {"fieldManager": f"{FIELD_MANAGER}-records"}
        path = KINDS[kind].path(namespace, name)
        return self._json("patch", kind, "PATCH", path, query, body, "application/merge-patch+json")

    def delete(
        self, kind: str, namespace: str | None, name: str, propagation: str = "Background"
    ) -> bool:
        """False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        try:
            self.request("delete", kind, "DELETE", KINDS[kind].path(namespace, name), body=body)
        except NotFound:
            return False
        return True

    def pod_log(
        self, namespace: str, pod: str, tail_lines: int | None = None, container: str = ""
    ) -> str:
        query = {"tailLines": str(tail_lines)} if tail_lines else {}
        if container:  # a pod with sidecars (a service mesh) needs it named
            query["container"] = container
        path = KINDS["Pod"].path(namespace, pod) + "/log"
        return self.request("log", "Pod", "GET", path, query or None).decode("utf-8", "replace")

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.requests)


def _selector(selector: Mapping[str, str] | str) -> str:
    if isinstance(selector, str):
        return selector
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def _watch_configuration(api: k8s.ApiClient) -> k8s.Configuration:
    configuration = copy.copy(api.configuration)
    configuration.connection_pool_maxsize = 1024
    return configuration


def _events(response: Any, kind: str) -> Iterator[dict[str, Any]]:
    """Parsed lines of a watch stream; an ``ERROR`` event raises."""
    pending = b""
    for chunk in response.stream(64 * 1024):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            event = json.loads(line)
            if event.get("type") == "ERROR":
                status = event.get("object") or {}
                code, message = int(status.get("code") or 0), str(status.get("message") or "")
                if code == 410:
                    raise Expired(message or "410 Gone")
                raise _error(code or 500, str(status.get("reason") or ""), message)
            yield event


def _error(status: int, reason: str, message: str) -> KubeError:
    if status == 404:
        return NotFound(message)
    if status == 422:
        return Invalid(message)
    if status == 401:
        return Unauthorized(f"{reason or 'Unauthorized'}: {message}")
    if status == 403:
        return Forbidden(f"{reason or 'Forbidden'}: {message}")
    if status in (409, 429) or status >= 500:
        return KubeUnavailable(f"HTTP {status} {reason}: {message}")
    return Invalid(f"HTTP {status} {reason}: {message}")


def _reason(exc: BaseException) -> str:
    inner = getattr(exc, "reason", None) or exc
    text = str(inner)
    if "Connection refused" in text:
        return "connection refused"
    return text.split(": ", 1)[-1][:200] if ": " in text else text[:200]


def own_namespace(default: str = "gitops-sless") -> str:
    """The pod's namespace in a cluster, else ``default``."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or default
    except OSError:
        return default


def api_host(client: KubeClient) -> tuple[str, int, bool]:
    parts = urlsplit(client.host)
    tls = parts.scheme == "https"
    return parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80), tls
