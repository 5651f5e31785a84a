"""The groups of ``gitops-sless serve``'s flags that belong to one part each: the
Kubernetes backend, previews, autoscaling, asynchronous invocations, notifications,
tracing."""

from __future__ import annotations

import argparse
import os
import re
from urllib.parse import urlsplit

from .common import UsageError

__all__ = [
    "KUBE_FLAGS",
    "TRUST_LEVELS",
    "add_async_flags",
    "add_kube_flags",
    "add_preview_flags",
    "add_scaling_flags",
    "add_tracing_flags",
    "duration",
    "env_choice",
    "otlp_endpoint",
    "trace_url_template",
]

# trust.TRUST_LEVELS, written again here: the server stack loads only for serve
TRUST_LEVELS = ("same-repo", "approved", "all")


def env_choice(name: str, default: str) -> str:
    # argparse checks the choices of values given on the command line only: a value from
    # the environment is checked by _choice, so a typo there is a usage error as well
    return os.environ.get(name) or default


# --flag, environment variable, help: the Kubernetes backend's settings (kube/settings.py)
KUBE_FLAGS = (
    ("--kubeconfig", "KUBECONFIG", "kubeconfig file (in a pod: its service account)"),
    ("--kube-context", None, "kubeconfig context (default: the current one)"),
    ("--namespace", "SLESS_NAMESPACE", "the reconciler's namespace, where builds run"),
    ("--namespace-prefix", "SLESS_NAMESPACE_PREFIX", "environment E lives in <prefix>E"),
    ("--registry", "SLESS_REGISTRY", "image repository prefix, e.g. registry.example.com/team"),
    ("--pull-secret", "SLESS_PULL_SECRET", "docker-registry Secret for pulls, copied to envs"),
    ("--push-secret", "SLESS_PUSH_SECRET", "docker-registry Secret kaniko pushes with"),
    ("--s3-endpoint", "SLESS_S3_ENDPOINT", "S3 endpoint for build contexts, with scheme"),
    ("--s3-bucket", "SLESS_S3_BUCKET", "S3 bucket for build contexts"),
    ("--s3-region", "SLESS_S3_REGION", "S3 region"),
    ("--kaniko-image", "SLESS_KANIKO_IMAGE", "kaniko executor image, pinned"),
    ("--build-cpu", "SLESS_BUILD_CPU", "CPU request of a build pod"),
    ("--build-memory", "SLESS_BUILD_MEMORY", "memory request and limit of a build pod"),
    ("--build-service-account", "SLESS_BUILD_SERVICE_ACCOUNT", "service account of build pods"),
    ("--gateway", "SLESS_GATEWAY", "NAMESPACE/NAME of a Gateway that serves /fn/ (HTTPRoutes)"),
)


def add_kube_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--backend",
        choices=("local", "kubernetes"),
        default=env_choice("SLESS_BACKEND", "local"),
        help="where functions run (default: $SLESS_BACKEND or local)",
    )
    group = serve.add_argument_group("Kubernetes backend (--backend kubernetes)")
    for flag, variable, text in KUBE_FLAGS:
        where = f" (default: ${variable})" if variable else ""
        group.add_argument(flag, default=None, help=text + where)


def add_preview_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("pull-request previews (--previews)")
    group.add_argument(
        "--previews", action="store_true", help="one environment pr-N per open pull request"
    )
    group.add_argument(
        "--preview-filter",
        default=os.environ.get("SLESS_PREVIEW_FILTER", ""),
        metavar="KEY=VALUE,...",
        help="base=BRANCH (default: --branch), label=NAME, branch=PATTERN (head branch)",
    )
    group.add_argument(
        "--preview-trust",
        choices=TRUST_LEVELS,
        default=env_choice("SLESS_PREVIEW_TRUST", "same-repo"),
        help="whose pull requests run: same-repo (heads in this repository), approved (also "
        "forks, each commit approved by a user with write access), all (every PR: private "
        "repositories only) (default: $SLESS_PREVIEW_TRUST or same-repo)",
    )
    group.add_argument(
        "--preview-approve-label",
        default=os.environ.get("SLESS_PREVIEW_APPROVE_LABEL") or "preview",
        metavar="LABEL",
        help="with --preview-trust approved: the label a user with write access adds to "
        "approve a fork's current commit (default: $SLESS_PREVIEW_APPROVE_LABEL or preview)",
    )
    group.add_argument(
        "--preview-secrets-dir",
        default=os.environ.get("SLESS_PREVIEW_SECRETS_DIR") or None,
        metavar="DIR",
        help="the previews' secrets, DIR/NAME/KEY; production's are never given to a "
        "preview (default: $SLESS_PREVIEW_SECRETS_DIR; none: previews get no secret)",
    )
    group.add_argument(
        "--max-previews", type=int, default=10, help="previews at once; more wait (default: 10)"
    )
    group.add_argument(
        "--preview-ttl",
        default="7d",
        metavar="DURATION",
        help="a preview with no new commit for this long is removed: 90s, 30m, 12h, 7d",
    )
    group.add_argument(
        "--instance-name",
        default=os.environ.get("SLESS_INSTANCE_NAME", "gitops-sless"),
        help="names this reconciler in commit statuses and PR comments (default: gitops-sless)",
    )
    group.add_argument(
        "--forge",
        choices=("github", "gitea", "gitlab"),
        default=os.environ.get("SLESS_FORGE") or None,
        help="the forge's kind, when its host does not say (default: $SLESS_FORGE)",
    )
    group.add_argument(
        "--forge-api",
        default=os.environ.get("SLESS_FORGE_API") or None,
        help="the forge's API base URL (default: from the repository URL)",
    )


def add_scaling_flags(serve: argparse.ArgumentParser) -> None:
    scaling = serve.add_argument_group("autoscaling (functions with a scale block)")
    scaling.add_argument(
        "--scale-window",
        default="60s",
        metavar="DURATION",
        help="concurrency is averaged over this stable window (default: 60s, as Knative)",
    )
    scaling.add_argument(
        "--scale-panic-window",
        default="6s",
        metavar="DURATION",
        help="a burst that this window sees at twice the ready replicas scales up at once, "
        "and nothing scales down for a stable window (default: 6s)",
    )
    scaling.add_argument(
        "--scale-tick",
        default="1s",
        metavar="DURATION",
        help="how often the autoscaler decides (default: 1s)",
    )


def add_async_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("asynchronous invocations (Prefer: respond-async, /async/)")
    group.add_argument(
        "--queue",
        default=os.environ.get("SLESS_QUEUE") or None,
        metavar="sqlite|nats://HOST:PORT",
        help="where accepted invocations are kept: sqlite (the state folder; the local "
        "backend's default) or a NATS JetStream server (every replica consumes; the "
        "Kubernetes backend needs it) (default: $SLESS_QUEUE)",
    )
    group.add_argument(
        "--invocation-retention",
        default=os.environ.get("SLESS_INVOCATION_RETENTION") or "24h",
        metavar="DURATION",
        help="how long an ended invocation's record (and its Idempotency-Key) is kept "
        "(default: $SLESS_INVOCATION_RETENTION or 24h)",
    )
    group.add_argument(
        "--callback-allow",
        default=os.environ.get("SLESS_CALLBACK_ALLOW", ""),
        metavar="CIDR,...",
        help="networks an X-Callback-Url may reach although private, loopback or link-local "
        "(default: $SLESS_CALLBACK_ALLOW; none)",
    )


def add_notify_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--notify-config",
        default=os.environ.get("SLESS_NOTIFY_CONFIG") or None,
        metavar="FILE",
        help="notifications of deploys and failures: a YAML file of providers (webhook, "
        "slack, teams, forge), the events each receives and the environments and functions "
        "it hears of (schemas/notify.schema.json) (default: $SLESS_NOTIFY_CONFIG; none: "
        "rollouts are reported to the forge, as without it)",
    )


def add_tracing_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
        metavar="URL",
        help="export OpenTelemetry traces of every call and reconcile pass over OTLP/HTTP to "
        "URL (http://collector:4318; /v1/traces is added), named by $OTEL_SERVICE_NAME "
        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT, else none)",
    )
    serve.add_argument(
        "--trace-url-template",
        default=os.environ.get("SLESS_TRACE_URL_TEMPLATE", ""),
        metavar="URL",
        help="a trace viewer's URL with {trace_id} in it (e.g. "
        "http://jaeger:16686/trace/{trace_id}): the dashboard links each call's trace "
        "(default: $SLESS_TRACE_URL_TEMPLATE, else no links)",
    )


def otlp_endpoint(value: str | None) -> str | None:
    """An OTLP/HTTP collector's http(s) URL; a bad one is refused before anything starts."""
    if value is None:
        return None
    parsed = urlsplit(value.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UsageError(
            f"--otlp-endpoint {value!r}: not an http(s) URL (e.g. http://collector:4318)"
        )
    return value.strip()


def trace_url_template(value: str) -> str:
    """A trace viewer's http(s) URL with ``{trace_id}``; a bad one is refused at the start."""
    if not value:
        return ""
    parsed = urlsplit(value.replace("{trace_id}", "0"))
    if "{trace_id}" not in value or parsed.scheme not in ("http", "https"):
        raise UsageError(
            f"--trace-url-template {value!r}: an http(s) URL with {{trace_id}} in it "
            "(e.g. http://jaeger:16686/trace/{trace_id})"
        )
    return value


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")


def duration(flag: str, text: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"{flag} {text!r}: expected a positive duration such as 90s, 12h, 7d")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return float(match.group(1)) * unit
