"""What ``gitops-sless serve`` is asked to do: every option of the command, as values."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errordetail import DEFAULT as DEFAULT_ERROR_DETAILS
from ..errordetail import ErrorDetails
from ..scaling.autoscaler import Windows

__all__ = ["ServeConfig"]


@dataclass(frozen=True)
class ServeConfig:
    repo: str
    state_dir: Path
    branch: str = "main"
    env: str = "prod"
    host: str = "127.0.0.1"
    port: int = 8080
    fn_listen: tuple[str, int] | None = None  # (host, port) serving /fn/ alone; None: port
    poll_interval: float = 30.0
    api_token: str | None = None
    token_file: Path | None = None  # where the API token was generated (none configured)
    read_token: str | None = None  # reads only: the dashboard, /metrics, the status API
    anonymous_read: bool = False  # reads need no token, even off loopback
    webhook_secret: str | None = None  # every forge's that has none of its own (weaker)
    webhook_secrets: tuple[tuple[str, str], ...] = ()  # (forge, secret): a forge's own
    secrets_dir: Path | None = None
    max_builds: int = 2
    build_timeout: float = 600.0
    fetch_timeout: float = 120.0  # overall deadline of one fetch
    ssh_known_hosts: Path | None = None  # the host keys an ssh:// repo may present
    max_body_bytes: int = 1 << 20
    log_format: str = "text"  # text | json (gitops_sless.logs)
    log_level: str = "info"
    keep_builds: int = 3  # builds kept per function folder beyond those in use
    keep_revisions: int = 5  # revisions of each function kept runnable (state.revisions)
    otlp_endpoint: str | None = None  # OpenTelemetry traces go there (gitops_sless.telemetry)
    service_name: str = "gitops-sless"  # OTEL_SERVICE_NAME
    trace_url_template: str = ""  # a trace viewer's URL with {trace_id}: the dashboard links it
    gc_interval: float = 3600.0  # seconds between garbage collections (state folder, cluster)
    gc_min_age: float = 3600.0  # kubernetes: nothing younger is collected (kube/gc.py)
    trusted_proxies: tuple[str, ...] = ()  # CIDRs whose forwarding headers are kept
    allow_empty: bool = False  # a commit declaring no function may prune every function
    backend: str = "local"  # local | kubernetes
    sandbox: str = "auto"  # local backend: auto | bubblewrap | off (local.sandbox.MODES)
    kube: Any = None  # kube.settings.KubeSettings, for --backend kubernetes
    previews: bool = False  # one environment per open pull request
    preview_base: str | None = None  # PRs into this branch (default: the tracked branch)
    preview_label: str | None = None
    preview_branch: str | None = None  # fnmatch pattern of head branches
    max_previews: int = 10
    preview_ttl: float = 7 * 86400
    preview_trust: str = "same-repo"  # same-repo | approved | all (trust.TRUST_LEVELS)
    preview_approve_label: str = "preview"
    preview_secrets_dir: Path | None = None  # the previews' secrets; none: no secret
    instance_name: str = "gitops-sless"  # names this reconciler in commit statuses
    forge_token: str | None = None
    forge_kind: str | None = None
    forge_api: str | None = None
    # the autoscaler's windows (scaling.autoscaler.Windows): Knative's 60 s and 6 s
    scale_windows: Windows = field(default_factory=Windows)
    # asynchronous invocations: "sqlite" (in the state folder) or nats://host:port; None:
    # sqlite on the local backend, none on Kubernetes (a pod's disk is not durable)
    queue: str | None = None
    invocation_retention: float = 86400.0  # ended invocations are kept this long
    callback_allow: tuple[str, ...] = ()  # CIDRs a callback URL may resolve to after all
    error_details: ErrorDetails = DEFAULT_ERROR_DETAILS  # whose callers read an exception
    notify_config: Path | None = None  # notifications' providers (gitops_sless.notify)

    @property
    def public_url(self) -> str:
        return _url(self.host, self.port)

    @property
    def fn_url(self) -> str:
        """Where functions answer: the --fn-listen address, else the server's own."""
        return _url(*self.fn_listen) if self.fn_listen else self.public_url


def _url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"
