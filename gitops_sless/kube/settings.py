"""How ``serve --backend kubernetes`` is configured, and the checks it makes before serving.

Every setting is a flag whose default is an environment variable (the
README's configuration table lists them). At start the backend checks what it
needs: the API server answers and accepts the credentials, the reconciler's
namespace exists, the bucket is reachable and writable. A failure is one
line (:class:`StartupError`), never a traceback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errordetail import DEFAULT as DEFAULT_ERROR_DETAILS
from ..errordetail import ErrorDetails
from ..errors import PermanentError, SlessError
from . import netpolicy
from .client import KubeClient, KubeUnavailable, own_namespace
from .renderer import RenderConfig, parse_gateway
from .storage import S3Config

__all__ = ["DEFAULT_KANIKO_IMAGE", "KubeSettings", "StartupError", "check"]

log = logging.getLogger(__name__)

DEFAULT_KANIKO_IMAGE = "gcr.io/kaniko-project/executor:v1.23.2"
DEFAULT_FETCH_IMAGE = "curlimages/curl:8.11.1"  # curl checks the S3 endpoint's certificate


class StartupError(PermanentError):
    """Something the backend needs is missing or refused; one line says which."""


@dataclass(frozen=True)
class KubeSettings:
    namespace: str
    namespace_prefix: str = "sless-"
    registry: str = "localhost:5000/sless"
    pull_secret: str | None = None
    push_secret: str | None = None
    s3: S3Config = field(default_factory=lambda: S3Config(endpoint="", bucket=""))
    kaniko_image: str = DEFAULT_KANIKO_IMAGE
    build_timeout: int = 1800
    build_cpu: str = "500m"
    build_memory: str = "1Gi"
    build_service_account: str | None = None
    fetch_image: str = DEFAULT_FETCH_IMAGE
    untrusted_namespace: str = "gitops-sless-untrusted"
    untrusted_registry: str | None = None  # None: <registry>/untrusted
    untrusted_push_secret: str | None = None
    build_runtime_class: str | None = None
    reconciler_labels: tuple[tuple[str, str], ...] = netpolicy.DEFAULT_RECONCILER_LABELS
    preview_egress: tuple[str, ...] = ()
    gateway: tuple[str, str] | None = None  # (namespace, name): --gateway, SLESS_GATEWAY
    reconciler_service: str = "gitops-sless"  # where --gateway routes idle functions
    error_details: ErrorDetails = DEFAULT_ERROR_DETAILS  # serve --error-details
    otlp_endpoint: str | None = None  # serve --otlp-endpoint: the runtimes' spans go there
    kubeconfig: str | None = None
    context: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: Any) -> KubeSettings:
        """Defaults from the environment; ``overrides`` (command-line flags) win when not None."""

        def get(name: str, default: str | None = None) -> str | None:
            return environ.get(name) or default

        values: dict[str, Any] = {
            "kubeconfig": get("KUBECONFIG"),
            "namespace": get("SLESS_NAMESPACE") or own_namespace(),
            "namespace_prefix": get("SLESS_NAMESPACE_PREFIX", "sless-"),
            "registry": get("SLESS_REGISTRY", "localhost:5000/sless"),
            "pull_secret": get("SLESS_PULL_SECRET"),
            "push_secret": get("SLESS_PUSH_SECRET"),
            "s3": S3Config.from_env(environ),
            "kaniko_image": get("SLESS_KANIKO_IMAGE", DEFAULT_KANIKO_IMAGE),
            "build_timeout": int(get("SLESS_BUILD_TIMEOUT", "1800") or 1800),
            "build_cpu": get("SLESS_BUILD_CPU", "500m"),
            "build_memory": get("SLESS_BUILD_MEMORY", "1Gi"),
            "build_service_account": get("SLESS_BUILD_SERVICE_ACCOUNT"),
            "fetch_image": get("SLESS_FETCH_IMAGE", DEFAULT_FETCH_IMAGE),
            "untrusted_namespace": get("SLESS_UNTRUSTED_BUILD_NAMESPACE", "gitops-sless-untrusted"),
            "untrusted_registry": get("SLESS_UNTRUSTED_REGISTRY"),
            "untrusted_push_secret": get("SLESS_UNTRUSTED_PUSH_SECRET"),
            "build_runtime_class": get("SLESS_BUILD_RUNTIME_CLASS"),
            **_network_settings(environ),
        }
        given = {k: v for k, v in overrides.items() if v is not None}
        values.update(given)
        values["gateway"] = _gateway(values.get("gateway"), given, environ)
        return cls(**values)

    def render_config(self) -> RenderConfig:
        return RenderConfig(
            registry=self.registry,
            namespace_prefix=self.namespace_prefix,
            controller_namespace=self.namespace,
            image_pull_secret=self.pull_secret,
            kaniko_image=self.kaniko_image,
            build_timeout_sec=self.build_timeout,
            build_cpu=self.build_cpu,
            build_memory=self.build_memory,
            build_service_account=self.build_service_account,
            push_secret=self.push_secret,
            fetch_image=self.fetch_image,
            untrusted_namespace=self.untrusted_namespace,
            untrusted_registry=self.untrusted_registry,
            untrusted_push_secret=self.untrusted_push_secret,
            build_runtime_class=self.build_runtime_class,
            reconciler_labels=self.reconciler_labels,
            preview_egress=self.preview_egress,
            gateway=self.gateway,
            reconciler_service=self.reconciler_service,
            error_details=self.error_details,
            otlp_endpoint=self.otlp_endpoint,
        )


def _network_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """What the environments' NetworkPolicies admit; a bad value stops the start in one line."""
    values: dict[str, Any] = {}
    labels = environ.get("SLESS_RECONCILER_LABELS")
    try:
        if labels is not None:
            values["reconciler_labels"] = netpolicy.parse_labels(labels)
    except ValueError as exc:
        raise StartupError(f"SLESS_RECONCILER_LABELS: {exc}") from exc
    try:
        values["preview_egress"] = netpolicy.parse_cidrs(environ.get("SLESS_PREVIEW_EGRESS", ""))
    except ValueError as exc:
        raise StartupError(f"SLESS_PREVIEW_EGRESS: {exc}") from exc
    return values


def _gateway(
    value: Any, given: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[str, str] | None:
    """The Gateway that serves /fn/, from --gateway or SLESS_GATEWAY; a bad one stops the
    start in one line naming where it came from."""
    if value is None and "gateway" not in given:
        value = environ.get("SLESS_GATEWAY") or None
    if value is None or isinstance(value, tuple):
        return value
    source = "--gateway" if "gateway" in given else "SLESS_GATEWAY"
    try:
        return parse_gateway(str(value))
    except ValueError as exc:
        raise StartupError(f"{source}: {exc}") from exc


def check(client: KubeClient, settings: KubeSettings, bucket_check: Any) -> None:
    """Raise StartupError naming the first thing missing."""
    where = f"Kubernetes API at {client.host}"
    attempts, client.attempts = client.attempts, 2  # a start-up check fails fast
    try:
        client.version()
        if client.get("Namespace", None, settings.namespace) is None:
            raise StartupError(
                f"namespace {settings.namespace} does not exist: create it "
                f"(kubectl create namespace {settings.namespace}) or set SLESS_NAMESPACE"
            )
        client.list("Job", settings.namespace)  # may we work in it at all
        _refuse_shared(settings)
    except KubeUnavailable as exc:
        raise StartupError(f"{where}: unreachable ({exc})") from exc
    except StartupError:
        raise
    except SlessError as exc:
        raise StartupError(f"{where}: {exc}") from exc
    finally:
        client.attempts = attempts
    if not settings.s3.endpoint or not settings.s3.bucket:
        raise StartupError("S3 is not configured: set SLESS_S3_ENDPOINT and SLESS_S3_BUCKET")
    try:
        bucket_check()
    except SlessError as exc:
        raise StartupError(str(exc)) from exc
    _warn_without_untrusted_namespace(client, settings)


def _refuse_shared(settings: KubeSettings) -> None:
    """Untrusted builds must be apart: another namespace, another repository."""
    untrusted = settings.untrusted_namespace
    if untrusted == settings.namespace:
        raise StartupError(
            f"SLESS_UNTRUSTED_BUILD_NAMESPACE={untrusted} is the reconciler's own namespace: "
            "untrusted builds must run apart"
        )
    if settings.untrusted_registry and settings.untrusted_registry == settings.registry:
        raise StartupError(
            f"SLESS_UNTRUSTED_REGISTRY={settings.untrusted_registry} is SLESS_REGISTRY: "
            "untrusted builds must push elsewhere"
        )


def _warn_without_untrusted_namespace(client: KubeClient, settings: KubeSettings) -> None:
    """It is needed only once a fork's preview builds: its absence is a warning."""
    untrusted = settings.untrusted_namespace
    try:
        missing = client.get("Namespace", None, untrusted) is None
    except SlessError:
        return  # it is looked for again when a build needs it
    if missing:
        log.warning(
            "namespace %s does not exist: builds of untrusted previews fail until it does "
            "(kubectl create namespace %s, or set SLESS_UNTRUSTED_BUILD_NAMESPACE)",
            untrusted,
            untrusted,
        )
