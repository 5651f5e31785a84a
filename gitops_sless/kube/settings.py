"""How ``serve --backend kubernetes`` is configured, and the checks it makes before serving.

Every setting is a flag whose default is an environment variable (the
README's configuration table lists them). At start the backend checks what it
needs: the API server answers and accepts the credentials, the reconciler's
namespace exists, the bucket is reachable and writable. A failure is one
line (:class:`StartupError`), never a traceback.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PermanentError, SlessError
from ..renderer import MANAGED_BY, RenderConfig
from .client import KubeClient, KubeUnavailable, own_namespace
from .storage import S3Config

__all__ = ["DEFAULT_KANIKO_IMAGE", "KubeSettings", "StartupError", "check"]

log = logging.getLogger(__name__)

DEFAULT_KANIKO_IMAGE = "gcr.io/kaniko-project/executor:v1.23.2"
BUILD_SECRET = "gitops-sless-build"


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
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
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
            s3_bucket=self.s3.bucket,
            s3_endpoint=self.s3.endpoint,
            s3_region=self.s3.region,
            s3_secret=BUILD_SECRET,
            push_secret=self.push_secret,
        )


def check(client: KubeClient, settings: KubeSettings, bucket_check: Any) -> None:
    """Raise StartupError naming the first thing missing; then bring the build Secret in step."""
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
    ensure_build_secret(client, settings)


def ensure_build_secret(client: KubeClient, settings: KubeSettings) -> None:
    """The Secret kaniko reads S3 credentials from, equal to the reconciler's own."""
    data = {
        "AWS_ACCESS_KEY_ID": _b64(settings.s3.access_key),
        "AWS_SECRET_ACCESS_KEY": _b64(settings.s3.secret_key),
    }
    live = client.get("Secret", settings.namespace, BUILD_SECRET)
    if live is not None and live.get("data") == data:
        return  # compared by content: a pass with nothing new writes nothing
    client.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": BUILD_SECRET,
                "namespace": settings.namespace,
                "labels": {MANAGED_BY: "gitops-sless"},
            },
            "type": "Opaque",
            "data": data,
        }
    )


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()
