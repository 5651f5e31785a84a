"""Kubernetes objects for one environment, from the desired state and ``templates/``.

Rendering is deterministic: env sorted, keys in template order, no time or
revision in any object. Every object carries the managed-by, environment and
function labels, and a hash of its own spec, so an object whose live hash
matches never needs writing again.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..errordetail import DEFAULT as DEFAULT_ERROR_DETAILS
from ..errordetail import ErrorDetails
from ..manifests import runtimes
from ..manifests.model import DesiredState, Function, Job, JobRef, SecretRef, is_preview
from ..plan.backend import Deployment
from . import netpolicy, templates
from .policy import ROUTE_ANNOTATION, route_policy
from .templates import OMIT

__all__ = [
    "ENV_LABEL",
    "FUNCTION_LABEL",
    "MANAGED_BY",
    "SPEC_HASH",
    "RenderConfig",
    "Rendered",
    "dump",
    "image_ref",
    "parse_gateway",
    "pinned_image",
    "render_environment",
    "render_function",
    "render_http_route",
    "render_job",
    "route_timeout",
    "spec_hash",
]

MANAGED_BY = "app.kubernetes.io/managed-by"
ENV_LABEL = "gitops-sless.dev/environment"
FUNCTION_LABEL = "gitops-sless.dev/function"
JOB_LABEL = "gitops-sless.dev/job"
RUN_LABEL = "gitops-sless.dev/run-id"
BUILD_LABEL = "gitops-sless.dev/build-tag"
SPEC_HASH = "gitops-sless.dev/spec-hash"
# the commit an object was last written at, and the function spec it runs: facts about
# the write, kept out of the spec hash so a new commit alone never rewrites an object
REVISION = "gitops-sless.dev/revision"
FUNCTION_HASH = "gitops-sless.dev/function-hash"
OBJECT_COUNT = "gitops-sless.dev/objects"  # how many long-running objects the function has
UNHASHED = frozenset({SPEC_HASH, REVISION})
CONTAINER_PORT = 8080
TRUST_LABEL = "gitops-sless.dev/trust"  # on build Jobs: trusted or untrusted
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)


def parse_gateway(text: str) -> tuple[str, str]:
    """``NAMESPACE/NAME`` of a Gateway -> (namespace, name); ValueError says what is wrong."""
    namespace, slash, name = text.strip().partition("/")
    if not slash or not namespace or not name:
        raise ValueError(f"{text!r} is not NAMESPACE/NAME (e.g. envoy-gateway-system/sless)")
    if not _DNS_LABEL.fullmatch(namespace):
        raise ValueError(f"{text!r}: the namespace {namespace!r} is not a DNS-1123 label")
    if not _DNS_SUBDOMAIN.fullmatch(name):
        raise ValueError(f"{text!r}: the name {name!r} is not a DNS-1123 subdomain")
    return namespace, name


@dataclass(frozen=True)
class RenderConfig:
    """Where images go and how the cluster is laid out (command-line or config file)."""

    registry: str = "localhost:5000/sless"
    namespace_prefix: str = "sless-"
    controller_namespace: str = "gitops-sless"
    image_pull_secret: str | None = None
    kaniko_image: str = "gcr.io/kaniko-project/executor:v1.23.2"
    build_timeout_sec: int = 1800
    build_cpu: str = "500m"
    build_memory: str = "1Gi"
    build_service_account: str | None = None  # None: the namespace's default, no token
    build_ttl_sec: int = 3600  # finished build Jobs are deleted after this long
    push_secret: str | None = None  # a docker-registry Secret kaniko pushes with
    fetch_image: str = "curlimages/curl:8.11.1"  # fetches the build context (curl)
    # builds of code nobody vouched for (a fork's preview): elsewhere, with other credentials
    untrusted_namespace: str = "gitops-sless-untrusted"
    untrusted_registry: str | None = None  # None: <registry>/untrusted
    untrusted_push_secret: str | None = None  # a Secret in untrusted_namespace
    build_runtime_class: str | None = None  # e.g. gvisor, for untrusted builds
    progress_deadline_sec: int = 600
    # the labels of the reconciler's pods: with its namespace, all a function admits besides
    # its own namespace (build pods in that namespace carry other labels)
    reconciler_labels: tuple[tuple[str, str], ...] = netpolicy.DEFAULT_RECONCILER_LABELS
    # CIDRs preview pods may reach besides DNS and their own namespace (SLESS_PREVIEW_EGRESS)
    preview_egress: tuple[str, ...] = ()
    # (namespace, name) of the Gateway that serves /fn/ in the cluster (--gateway): each
    # http function also gets an HTTPRoute, and that namespace reaches the functions' port
    gateway: tuple[str, str] | None = None
    # the reconciler's Service (port 80, in controller_namespace): an autoscaled function's
    # HTTPRoute sends calls there while no replica serves (deploy/service.yaml)
    reconciler_service: str = "gitops-sless"
    # whose callers read a handler's exception (serve --error-details)
    error_details: ErrorDetails = DEFAULT_ERROR_DETAILS
    # the OTLP/HTTP collector (serve --otlp-endpoint): the runtimes send their spans there
    otlp_endpoint: str | None = None

    def namespace(self, environment: str) -> str:
        return f"{self.namespace_prefix}{environment}"

    def build_registry(self, trusted: bool = True) -> str:
        return self.registry if trusted else self.untrusted_registry or f"{self.registry}/untrusted"


@dataclass
class Rendered:
    """The objects of one environment, and the functions not rendered yet."""

    objects: list[dict[str, Any]] = field(default_factory=list)
    # function -> the jobs whose results it still waits for
    waiting: dict[str, list[str]] = field(default_factory=dict)


def image_ref(config: RenderConfig, tag: str, trusted: bool = True) -> str:
    """Where a build pushes ``tag`` (what runs is pinned by digest: :func:`pinned_image`)."""
    return f"{config.build_registry(trusted)}/functions:{tag}"


def pinned_image(config: RenderConfig, digest: str, trusted: bool = True) -> str:
    """The image a build pushed, by its digest: a tag pushed again changes nothing that runs."""
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"{digest!r} is not an image digest (sha256:<64 hex digits>)")
    return f"{config.build_registry(trusted)}/functions@{digest}"


def spec_hash(obj: Mapping[str, Any]) -> str:
    """sha256 of the object's canonical JSON, ignoring the hash annotation itself."""
    meta = dict(obj.get("metadata", {}))
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k not in UNHASHED}
    meta["annotations"] = annotations
    canonical = json.dumps({**obj, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _finish(
    obj: dict[str, Any], labels: Mapping[str, str], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    meta = obj.setdefault("metadata", {})
    meta["labels"] = {**meta.get("labels", {}), **labels}
    meta["annotations"] = {**meta.get("annotations", {}), **(annotations or {})}
    meta["annotations"][SPEC_HASH] = spec_hash(obj)
    return obj


def _env_labels(environment: str) -> dict[str, str]:
    return {MANAGED_BY: "gitops-sless", ENV_LABEL: environment}


def _function_labels(fn: Function, environment: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": fn.name,
        **_env_labels(environment),
        FUNCTION_LABEL: fn.name,
    }


def _replicas(fn: Function, environment: str, autoscaled: bool) -> Any:
    """``spec.replicas`` of an http function's Deployment: none when autoscaled (the
    autoscaler owns it, and an apply must not fight it), else the fixed count (0: disabled)."""
    if autoscaled:
        return OMIT
    return fn.scale_in(environment).min if fn.enabled else 0


def _env_var(name: str, value: str | SecretRef) -> dict[str, Any]:
    if isinstance(value, SecretRef):
        ref = {"name": value.secret, "key": value.key}
        return {"name": name, "valueFrom": {"secretKeyRef": ref}}
    return {"name": name, "value": value}


class _EnvironmentRenderer:
    def __init__(
        self,
        state: DesiredState | None,
        environment: str,
        config: RenderConfig,
        job_results: Mapping[str, str],
        image: str | None = None,
    ) -> None:
        """``image``: what the workloads run (a pinned digest); None: the build tag's image."""
        self.state = state
        self.environment = environment
        self.config = config
        self.job_results = job_results
        self.image = image
        self.namespace = config.namespace(environment)

    def resolved(self, fn: Function) -> dict[str, str | SecretRef]:
        return {
            name: self.job_results[value.job] if isinstance(value, JobRef) else value
            for name, value in fn.env_for(self.environment).items()
        }

    def container_env(
        self, fn: Function, extra: Mapping[str, str], env_vars: Mapping[str, str | SecretRef]
    ) -> list[dict[str, Any]]:
        values: dict[str, str | SecretRef] = {
            "PORT": str(CONTAINER_PORT),
            "SLESS_ENTRYPOINT": fn.entrypoint,
            "SLESS_ENV": self.environment,
            "SLESS_FUNCTION_NAME": fn.name,
            "SLESS_TIMEOUT_SEC": str(fn.timeout_sec),
            **fn.runtime_env(),
            **self.config.error_details.runtime_env(self.environment),
            **self._otlp(fn),
            **extra,
            **env_vars,
        }
        return [_env_var(k, v) for k, v in sorted(values.items())]

    def _otlp(self, fn: Function) -> dict[str, str]:
        """Where the runtime sends its spans, as what service (serve --otlp-endpoint)."""
        if not self.config.otlp_endpoint:
            return {}
        return {
            "SLESS_OTLP_ENDPOINT": self.config.otlp_endpoint,
            "SLESS_OTLP_SERVICE": f"{self.environment}/{fn.name}",
        }

    def pod_spec(
        self,
        fn: Function,
        role: str,
        extra_env: Mapping[str, str],
        env_vars: Mapping[str, str | SecretRef],
    ) -> Any:
        runtime = runtimes.get(fn.runtime)
        serving = role == "server"
        probe = {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
        }
        secret = self.config.image_pull_secret
        return templates.render(
            "pod-spec",
            {
                "restartPolicy": "Always" if serving else "Never",
                # SIGTERM to SIGKILL: calls under way end, open streams and sockets drain
                "gracePeriod": fn.stop_grace_sec,
                "imagePullSecrets": [{"name": secret}] if secret else OMIT,
                "image": self.image or image_ref(self.config, fn.build_tag),
                "command": runtime.container_command(role),
                "env": self.container_env(fn, extra_env, env_vars),
                "ports": [{"name": "http", "containerPort": CONTAINER_PORT}] if serving else OMIT,
                "readinessProbe": probe if serving else OMIT,
                "memory": f"{fn.memory_mb}Mi",
            },
        )

    def base_values(self, name: str, labels: Mapping[str, str], fn: Function) -> dict[str, Any]:
        # the pods say which build they run: their image names only a digest
        pod_labels = {**labels, BUILD_LABEL: fn.build_tag}
        return {"name": name, "namespace": self.namespace, "podLabels": pod_labels}

    def function_objects(
        self,
        fn: Function,
        env_vars: Mapping[str, str | SecretRef],
    ) -> Iterator[dict[str, Any]]:
        labels = _function_labels(fn, self.environment)
        if fn.http:
            selector = {FUNCTION_LABEL: fn.name}
            route = route_policy(fn, self.environment)
            values = {
                **self.base_values(fn.name, labels, fn),
                "replicas": _replicas(fn, self.environment, route.scale is not None),
                "progressDeadline": self.config.progress_deadline_sec,
                "selector": selector,
                "podSpec": self.pod_spec(fn, "server", {}, env_vars),
            }
            encoded = route.encode()
            annotations = {ROUTE_ANNOTATION: encoded} if encoded else None
            yield _finish(templates.render("deployment", values), labels, annotations)
            yield _finish(templates.render("service", values), labels)
            if self.config.gateway:
                yield render_http_route(self.environment, fn.name, route_timeout(fn), self.config)
        for index, trigger in enumerate(fn.crons):
            event = {"SLESS_EVENT": json.dumps(trigger.event, sort_keys=True)}
            values = {
                **self.base_values(f"{fn.name}-cron-{index}", labels, fn),
                "schedule": trigger.schedule,
                "suspend": not fn.enabled,
                "activeDeadline": fn.timeout_sec,
                "podSpec": self.pod_spec(fn, "runner", event, env_vars),
            }
            yield _finish(templates.render("cronjob", values), labels)

    def job_object(
        self, fn: Function, job: Job, env_vars: Mapping[str, str | SecretRef]
    ) -> dict[str, Any]:
        labels = {
            **_function_labels(fn, self.environment),
            JOB_LABEL: job.name,
            RUN_LABEL: str(job.run_id),
        }
        event = {"SLESS_EVENT": json.dumps(job.event, sort_keys=True)}
        values = {
            **self.base_values(job_object_name(job), labels, fn),
            "activeDeadline": fn.timeout_sec,
            "podSpec": self.pod_spec(fn, "runner", event, env_vars),
        }
        return _finish(templates.render("job", values), labels)

    def environment_objects(self) -> Iterator[dict[str, Any]]:
        labels = _env_labels(self.environment)
        values = {
            "namespace": self.namespace,
            "controllerNamespace": self.config.controller_namespace,
        }
        yield _finish(templates.render("namespace", values), labels)
        ingress = {
            **values,
            "reconcilerLabels": dict(self.config.reconciler_labels),
            "port": CONTAINER_PORT,
            "gateway": self.gateway_ingress(),
        }
        yield _finish(templates.render("networkpolicy", ingress), labels)
        if is_preview(self.environment):
            yield _finish(templates.render("networkpolicy-egress", self.egress_values()), labels)

    def gateway_ingress(self) -> Any:
        """The gateway's pods (in its namespace, with the Envoy Gateway or NGINX Gateway
        Fabric layouts the README shows), on the runtime's port only."""
        if not self.config.gateway:
            return OMIT
        where = {"kubernetes.io/metadata.name": self.config.gateway[0]}
        return {
            "from": [{"namespaceSelector": {"matchLabels": where}}],
            "ports": [{"protocol": "TCP", "port": CONTAINER_PORT}],
        }

    def egress_values(self) -> dict[str, Any]:
        blocks = netpolicy.ip_blocks(self.config.preview_egress)
        return {
            "namespace": self.namespace,
            "dnsNamespace": netpolicy.DNS_NAMESPACE,
            "dnsPodLabels": dict(netpolicy.DNS_POD_LABELS),
            "allowed": {"to": blocks} if blocks else OMIT,
        }

    def build_objects(self) -> Iterator[dict[str, Any]]:
        assert self.state is not None
        seen: set[str] = set()
        for fn in sorted(self.state.functions.values(), key=lambda f: f.build_tag):
            if fn.build_tag not in seen:
                seen.add(fn.build_tag)
                yield build_job(fn, self.config)

    def render(self, builds: bool) -> Rendered:
        assert self.state is not None
        out = Rendered(objects=list(self.environment_objects()))
        if builds:
            out.objects.extend(self.build_objects())
        for fn in sorted(self.state.functions.values(), key=lambda f: f.name):
            for job in fn.jobs:
                if job.run_id > 0 and self.ready(fn, out):
                    out.objects.append(self.job_object(fn, job, self.resolved(fn)))
            if self.ready(fn, out):
                out.objects.extend(self.function_objects(fn, self.resolved(fn)))
        return out

    def ready(self, fn: Function, out: Rendered) -> bool:
        missing = [
            job for job in fn.job_dependencies(self.environment) if job not in self.job_results
        ]
        if missing:
            out.waiting[fn.name] = missing
        return not missing


def job_object_name(job: Job) -> str:
    """Deterministic per (name, runId): a second create of the same run is a no-op."""
    return f"{job.name}-run-{job.run_id}"


def build_job_name(tag: str) -> str:
    return "build-" + tag.replace(".", "-").replace("_", "-")


def build_job(
    fn: Function,
    config: RenderConfig,
    context_url: str | None = None,
    trusted: bool = True,
) -> dict[str, Any]:
    """The kaniko Job that builds ``fn``'s image (shared by every function of its tag).

    ``context_url``: a presigned GET URL of the context (None: a placeholder, for
    ``gitops-sless render``). An untrusted build runs in its own namespace, pushes to its
    own repository with its own Secret, and under the build runtime class if one is set.
    """
    labels = {
        MANAGED_BY: "gitops-sless",
        BUILD_LABEL: fn.build_tag,
        TRUST_LABEL: "trusted" if trusted else "untrusted",
    }
    push_secret = config.push_secret if trusted else config.untrusted_push_secret
    runtime_class = None if trusted else config.build_runtime_class
    values = {
        "name": build_job_name(fn.build_tag),
        "namespace": config.controller_namespace if trusted else config.untrusted_namespace,
        "podLabels": labels,
        "activeDeadline": config.build_timeout_sec,
        "kanikoImage": config.kaniko_image,
        "fetchImage": config.fetch_image,
        "contextUrl": context_url or f"<presigned GET URL of contexts/{fn.build_tag}.tar.gz>",
        "image": image_ref(config, fn.build_tag, trusted),
        # apart: an untrusted build must not seed layers a trusted build would reuse
        "cacheRepo": f"{config.build_registry(trusted)}/cache",
        "cpu": config.build_cpu,
        "memory": config.build_memory,
        "ttl": config.build_ttl_sec,
        "serviceAccount": config.build_service_account or OMIT,
        "runtimeClass": runtime_class or OMIT,
        "volumes": _build_volumes(push_secret),
        "kanikoMounts": [
            {"name": "workspace", "mountPath": "/workspace", "readOnly": True},
            *(
                [{"name": "registry-auth", "mountPath": "/kaniko/.docker", "readOnly": True}]
                if push_secret
                else []
            ),
        ],
    }
    return _finish(templates.render("build-job", values), labels)


def _build_volumes(push_secret: str | None) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": "workspace", "emptyDir": {"sizeLimit": "1Gi"}}]
    if push_secret:
        items = [{"key": ".dockerconfigjson", "path": "config.json"}]
        volumes.append(
            {"name": "registry-auth", "secret": {"secretName": push_secret, "items": items}}
        )
    return volumes


def render_function(
    deployment: Deployment,
    config: RenderConfig,
    revision: str | None = None,
    image: str | None = None,
) -> list[dict[str, Any]]:
    """The long-running objects of one function (Deployment, Service, HTTPRoute, CronJobs),
    env resolved;
    ``image``: the pinned image they run (None: the build tag's, for offline rendering)."""
    fn = deployment.function
    renderer = _EnvironmentRenderer(None, deployment.env, config, {}, image)
    http_objects = 3 if config.gateway else 2  # Deployment, Service (, HTTPRoute)
    count = (http_objects if fn.http else 0) + len(fn.crons)
    objects = list(renderer.function_objects(fn, deployment.env_vars))
    if objects:
        # on the first object only (the Deployment, else the first CronJob): a new image
        # must not rewrite a Service whose own spec did not change
        annotations = {FUNCTION_HASH: deployment.spec_hash, OBJECT_COUNT: str(count)}
        if revision:
            annotations[REVISION] = revision
        _finish(objects[0], {}, annotations)
    return objects


def route_timeout(fn: Function) -> int:
    """An HTTPRoute's request timeout for ``fn``: the Gateway API's bounds the whole
    exchange, so a function with a ``stream`` block gets its stream's time too."""
    return fn.timeout_sec + (fn.stream.max_sec if fn.stream is not None else 0)


def render_http_route(
    environment: str, name: str, timeout_sec: int | str, config: RenderConfig
) -> dict[str, Any]:
    """The HTTPRoute of an http function with ``--gateway``, as it serves (straight to its
    Service): from the function's name and timeout alone, so the route can be rendered
    again from its Deployment (see :mod:`.activator`)."""
    gateway_namespace, gateway_name = config.gateway or ("", "")
    values = {
        "name": name,
        "namespace": config.namespace(environment),
        "gatewayNamespace": gateway_namespace,
        "gatewayName": gateway_name,
        "prefix": f"/fn/{environment}/{name}",
        "timeout": f"{timeout_sec}s",
    }
    labels = {"app.kubernetes.io/name": name, **_env_labels(environment), FUNCTION_LABEL: name}
    return _finish(templates.render("httproute", values), labels)


def render_job(
    env: str,
    fn: Function,
    job: Job,
    env_vars: Mapping[str, str | SecretRef],
    config: RenderConfig,
    image: str | None = None,
) -> dict[str, Any]:
    """The Job of one run of ``job``, with the env its function runs with."""
    return _EnvironmentRenderer(None, env, config, {}, image).job_object(fn, job, env_vars)


def environment_objects(environment: str, config: RenderConfig) -> list[dict[str, Any]]:
    """The Namespace and NetworkPolicies of an environment (previews also deny egress)."""
    return list(_EnvironmentRenderer(None, environment, config, {}).environment_objects())


def render_environment(
    state: DesiredState,
    environment: str,
    config: RenderConfig | None = None,
    job_results: Mapping[str, str] | None = None,
    builds: bool = True,
) -> Rendered:
    """Every object of ``environment``; functions still waiting for job results are left out."""
    renderer = _EnvironmentRenderer(state, environment, config or RenderConfig(), job_results or {})
    return renderer.render(builds)


class _Dumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    # multi-line values print as literal blocks; everything else as PyYAML decides
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def dump(objects: list[dict[str, Any]]) -> str:
    """Multi-document YAML, byte-identical for identical objects."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)
