"""The ``gitops-sless`` command line.

``validate``, ``render`` and ``serve`` work on a repository; ``status``, ``diff``,
``logs``, ``invoke`` and ``sync`` talk to a running server (``--server URL``,
default ``$SLESS_SERVER`` or http://127.0.0.1:8080; reads send ``$SLESS_READ_TOKEN``,
else ``$SLESS_API_TOKEN``, and ``sync`` sends ``$SLESS_API_TOKEN``).

Exit codes: 0 success (everything Ready, no difference, a 2xx answer, a sync
that succeeded); 1 the answer is not (invalid manifests, a function not Ready,
a difference, a non-2xx answer, a failed sync, no such function); 2 an error:
bad arguments, a path or ref that cannot be read, a server that cannot be
reached or refuses the token.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import gitops_sless

from . import logs, manifest, renderer
from .client import Client, ClientError, NotFound, segment, server_url
from .errors import SlessError
from .source import DirectorySnapshot, Snapshot, open_source

__all__ = ["main"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
EXIT_NOT_OK, EXIT_ERROR = 1, 2  # the answer is not what was hoped for / could not get one
EXIT_INTERRUPTED = 130
POLL_SEC = 0.5  # logs -f: how often to ask for more
GOOD_PHASES = ("Ready", "Disabled")
# a last pass that says so: a job waits or failed, a build runs, a function failed
NOT_CONVERGED = ("Failed", "Degraded", "Progressing")
MAX_SYNC_WAIT = 600  # the server waits at most this long
_ENV_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
# webhooks.FORGES, named here so that a command other than serve loads no pydantic
WEBHOOK_FORGES = ("github", "gitea", "gitlab")


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        help="a functions repository: the files on disk of a directory or a git work tree "
        "(any folder of it), .gitignore honoured; a bare repository is read at HEAD",
    )
    parser.add_argument(
        "--ref",
        help="read this branch, tag or commit instead of the files on disk "
        "(PATH must be the root of a git repository)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gitops-sless", description="Serverless functions on Kubernetes, deployed by git push."
    )
    parser.add_argument(
        "--version", action="version", version=f"gitops-sless {gitops_sless.__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser("validate", help="check every sless.yaml of a repository")
    _add_source_args(validate)

    render = commands.add_parser(
        "render", help="print the Kubernetes objects of one environment as YAML"
    )
    _add_source_args(render)
    render.add_argument("--env", default="prod", help="environment name (default: prod)")
    render.add_argument(
        "--registry",
        default=os.environ.get("SLESS_REGISTRY", renderer.RenderConfig.registry),
        help="image registry and prefix, HOST/PREFIX (default: $SLESS_REGISTRY or %(default)s)",
    )
    render.add_argument(
        "--job-result",
        action="append",
        default=[],
        metavar="JOB=JSON",
        help="a job's result, for functions that take it as env (repeatable)",
    )
    render.add_argument("--no-builds", action="store_true", help="leave out the kaniko build Jobs")
    render.add_argument(
        "--gateway",
        default=os.environ.get("SLESS_GATEWAY") or None,
        metavar="NAMESPACE/NAME",
        help="a Gateway API Gateway: each http function also gets an HTTPRoute attached to it "
        "(default: $SLESS_GATEWAY)",
    )
    serve = commands.add_parser(
        "serve", help="follow a repository, build what changed, run it locally, proxy /fn/"
    )
    serve.add_argument(
        "--repo",
        required=True,
        help="URL (https://, ssh://, git://, file://) or local path; a plain directory is "
        "turned into a repository you can push to",
    )
    serve.add_argument("--branch", default="main", help="branch to follow (default: main)")
    serve.add_argument("--env", default="prod", help="environment name (default: prod)")
    serve.add_argument(
        "--listen", default="127.0.0.1:8080", help="HOST:PORT to serve on (default: %(default)s)"
    )
    serve.add_argument(
        "--state-dir", default=".sless-state", help="status store, artifacts, logs (%(default)s)"
    )
    serve.add_argument(
        "--poll-interval", type=float, default=30.0, help="seconds between polls (default: 30)"
    )
    serve.add_argument(
        "--api-token",
        default=os.environ.get("SLESS_API_TOKEN"),
        help="bearer token that reads and writes (POST /api/v1/sync, DELETE) "
        "(default: $SLESS_API_TOKEN)",
    )
    serve.add_argument(
        "--read-token",
        default=os.environ.get("SLESS_READ_TOKEN"),
        help="bearer token that only reads: the dashboard, the status API, logs, /metrics "
        "(default: $SLESS_READ_TOKEN)",
    )
    serve.add_argument(
        "--anonymous-read",
        action="store_true",
        help="serve reads (job results, logs, the dashboard) to anyone, even with a token set "
        "or off a loopback address",
    )
    serve.add_argument(
        "--webhook-secret",
        default=os.environ.get("SLESS_WEBHOOK_SECRET"),
        help="webhook secret of every forge that has none of its own; weaker, as GitLab sends "
        "its secret in clear (default: $SLESS_WEBHOOK_SECRET)",
    )
    for forge in WEBHOOK_FORGES:
        variable = f"SLESS_WEBHOOK_SECRET_{forge.upper()}"
        serve.add_argument(
            f"--webhook-secret-{forge}",
            default=os.environ.get(variable),
            help=f"webhook secret of {forge} alone (default: ${variable})",
        )
    serve.add_argument(
        "--secrets-dir", help="secrets for {secret: NAME, key: KEY}: one file per key, DIR/NAME/KEY"
    )
    serve.add_argument("--max-builds", type=int, default=2, help="concurrent builds (default: 2)")
    serve.add_argument(
        "--build-timeout",
        type=float,
        default=float(os.environ.get("SLESS_BUILD_TIMEOUT") or 600),
        help="seconds per build (default: $SLESS_BUILD_TIMEOUT or 600)",
    )
    serve.add_argument(
        "--sandbox",
        choices=_SANDBOX_MODES,
        default=_env_choice("SLESS_SANDBOX", "auto"),
        help="local backend: every function process and installer in a bubblewrap sandbox: "
        "auto (where bubblewrap works, else unconfined, with a warning), bubblewrap (or refuse "
        "to start), off (default: $SLESS_SANDBOX or auto)",
    )
    serve.add_argument(
        "--allow-empty",
        action="store_true",
        help="let a commit that declares no function prune every function (Argo CD's allowEmpty)",
    )
    _add_kube_flags(serve)
    _add_preview_flags(serve)
    serve.add_argument(
        "--fetch-timeout",
        type=float,
        metavar="SECONDS",
        help="overall deadline of one fetch of the repository; a fetch still running then is "
        "abandoned and the next pass tries again (default: $SLESS_FETCH_TIMEOUT or 120)",
    )
    serve.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=_env_choice("SLESS_LOG_FORMAT", "text"),
        help="one line per event as text or JSON (default: $SLESS_LOG_FORMAT or text)",
    )
    serve.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default=_env_choice("SLESS_LOG_LEVEL", "info"),
        help="least severe level logged (default: $SLESS_LOG_LEVEL or info)",
    )
    serve.add_argument(
        "--keep-builds",
        type=int,
        default=3,
        metavar="N",
        help="builds kept per function folder beyond those an environment uses (default: 3)",
    )
    serve.add_argument(
        "--gc-interval",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="seconds between garbage collections of the state folder, or of the cluster's "
        "build records, contexts and images (default: 3600)",
    )
    serve.add_argument(
        "--gc-min-age",
        type=float,
        default=float(os.environ.get("SLESS_GC_MIN_AGE") or 3600),
        metavar="SECONDS",
        help="Kubernetes backend: no build record, context or image younger than this "
        "is garbage-collected (default: $SLESS_GC_MIN_AGE or 3600)",
    )
    serve.add_argument(
        "--trusted-proxies",
        default=os.environ.get("SLESS_TRUSTED_PROXIES", ""),
        metavar="CIDR,...",
        help="CIDRs of the proxies whose forwarding headers are trusted "
        "(default: $SLESS_TRUSTED_PROXIES or none)",
    )
    _add_server_commands(commands)
    _add_import_command(commands)
    completion = commands.add_parser(
        "completion", help="print a shell completion script: source <(gitops-sless completion bash)"
    )
    completion.add_argument("shell", choices=("bash", "zsh"))
    return parser


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        metavar="URL",
        help="the gitops-sless serve to talk to (default: $SLESS_SERVER or "
        "http://127.0.0.1:8080); reads send $SLESS_READ_TOKEN or $SLESS_API_TOKEN, "
        "sync sends $SLESS_API_TOKEN",
    )


def _add_server_commands(commands: Any) -> None:
    status = commands.add_parser(
        "status", help="environments and functions of a running server, with their phases"
    )
    status.add_argument("--env", help="only this environment (default: every environment)")
    status.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="(default: table)"
    )
    _add_server_args(status)

    diff = commands.add_parser(
        "diff", help="what a sync of a folder (or --ref commit) would change on the server"
    )
    _add_source_args(diff)
    diff.add_argument(
        "--env", help="environment to compare with (default: the one the server follows)"
    )
    diff.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="(default: text)"
    )
    _add_server_args(diff)

    logs_cmd = commands.add_parser(
        "logs", help="what a function's replicas printed, its build log, or a job's result"
    )
    logs_cmd.add_argument(
        "function", metavar="ENV/NAME", help="the function (NAME alone: the server's environment)"
    )
    what = logs_cmd.add_mutually_exclusive_group()
    what.add_argument("--build", action="store_true", help="the log of its current build")
    what.add_argument("--job", metavar="JOB", help="the runs of one of its jobs: result or error")
    logs_cmd.add_argument(
        "-f", "--follow", action="store_true", help="keep printing what is added (Ctrl-C stops)"
    )
    _add_server_args(logs_cmd)

    invoke = commands.add_parser("invoke", help="call a function through the server's /fn/ proxy")
    invoke.add_argument(
        "function", metavar="ENV/NAME", help="the function (NAME alone: the server's environment)"
    )
    invoke.add_argument(
        "-d",
        "--data",
        metavar="JSON|@FILE",
        help="the request body: text, @FILE for a file's bytes, @- for standard input",
    )
    invoke.add_argument(
        "--path", default="/", help="the sub-path after /fn/ENV/NAME, with an optional ?query"
    )
    invoke.add_argument("-X", "--method", help="HTTP method (default: POST with --data, else GET)")
    invoke.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a request header (repeatable)",
    )
    invoke.add_argument(
        "--timeout", type=float, default=905.0, metavar="SECONDS", help="(default: %(default)g)"
    )
    _add_server_args(invoke)

    sync = commands.add_parser("sync", help="ask the server for a pass now and wait for its result")
    sync.add_argument(
        "--wait",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help=f"how long to wait for the pass, at most {MAX_SYNC_WAIT} (0: do not wait; "
        "default: %(default)g)",
    )
    _add_server_args(sync)


def _env_choice(name: str, default: str) -> str:
    # argparse checks the choices of values given on the command line only: a value from
    # the environment is checked by _choice, so a typo there is a usage error as well
    return os.environ.get(name) or default


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise _UsageError(f"{name} {value:g}: must be greater than 0")
    return value


def _deadline(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise _UsageError(f"{name} {value:g}: must be a number of seconds greater than 0")
    return value


def _fetch_timeout(value: float | None) -> float:
    """``--fetch-timeout``, else ``$SLESS_FETCH_TIMEOUT``, else 120 seconds."""
    if value is not None:
        return _deadline("--fetch-timeout", value)
    text = os.environ.get("SLESS_FETCH_TIMEOUT") or "120"
    try:
        seconds = float(text)
    except ValueError:
        raise _UsageError(f"$SLESS_FETCH_TIMEOUT {text!r}: not a number of seconds") from None
    return _deadline("$SLESS_FETCH_TIMEOUT", seconds)


_REPO_EXPECTED = (
    "expected a git repository, a folder of functions, or a URL (https://, ssh://, git://, file://)"
)


def _is_url(repo: str) -> bool:
    # git's rule: a colon before any slash makes it a URL (host:path, user@host:path)
    head, colon, _ = repo.partition(":")
    return "://" in repo or bool(colon and "/" not in head)


def _check_repo(repo: str) -> None:
    """A local --repo must be there now; a URL's remote is checked by each fetch."""
    if _is_url(repo):
        return
    path = Path(repo)
    if not path.exists():
        raise _UsageError(f"--repo {repo}: no such file or directory; {_REPO_EXPECTED}")
    if not path.is_dir():
        raise _UsageError(f"--repo {repo}: not a directory; {_REPO_EXPECTED}")


def _check_ssh_keys() -> None:
    for variable in ("SLESS_GIT_SSH_KEY", "SLESS_GIT_SSH_PUBKEY"):
        value = os.environ.get(variable)
        if value and not Path(value).is_file():
            raise _UsageError(f"${variable} {value}: no such file; expected an SSH key file")


def _seconds(name: str, value: float) -> float:
    if not value >= 0:
        raise _UsageError(f"{name} {value:g}: must be 0 or more")
    return value


def _not_negative(name: str, value: int) -> int:
    if value < 0:
        raise _UsageError(f"{name} {value}: must be 0 or more")
    return value


def _choice(env: str, value: str, choices: Sequence[str]) -> str:
    """A choice from the environment (argparse has checked the command line's)."""
    if value not in choices:
        raise _UsageError(f"${env} {value!r}: use one of {', '.join(choices)}")
    return value


def _trusted_proxies(value: str) -> tuple[str, ...]:
    networks = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        try:
            networks.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError as exc:
            raise _UsageError(f"--trusted-proxies {item!r}: not an IP network (CIDR)") from exc
    return tuple(networks)


def _webhook_secrets(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """(forge, secret) for each forge given a secret of its own."""
    pairs = ((forge, getattr(args, f"webhook_secret_{forge}")) for forge in WEBHOOK_FORGES)
    return tuple((forge, secret) for forge, secret in pairs if secret)


def _register_secrets(args: argparse.Namespace) -> None:
    """Every secret this process knows of, redacted from log lines before any is written."""
    for value in (
        args.api_token,
        args.read_token,
        args.webhook_secret,
        *dict(_webhook_secrets(args)).values(),
        os.environ.get("SLESS_GIT_PASSWORD"),
        os.environ.get("SLESS_GIT_SSH_PASSPHRASE"),
        os.environ.get("SLESS_FORGE_TOKEN"),
        os.environ.get("AWS_SECRET_ACCESS_KEY"),
    ):
        logs.register_secret(value)
    with contextlib.suppress(ValueError):  # not a URL: the mirror says so later
        logs.register_secret(urlsplit(args.repo).password)  # https://user:password@host/...


# --flag, environment variable, help: the Kubernetes backend's settings (kube/settings.py)
_KUBE_FLAGS = (
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


def _add_kube_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--backend",
        choices=("local", "kubernetes"),
        default=_env_choice("SLESS_BACKEND", "local"),
        help="where functions run (default: $SLESS_BACKEND or local)",
    )
    group = serve.add_argument_group("Kubernetes backend (--backend kubernetes)")
    for flag, variable, text in _KUBE_FLAGS:
        where = f" (default: ${variable})" if variable else ""
        group.add_argument(flag, default=None, help=text + where)


def _add_preview_flags(serve: argparse.ArgumentParser) -> None:
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
        choices=_TRUST_LEVELS,
        default=_env_choice("SLESS_PREVIEW_TRUST", "same-repo"),
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


# trust.TRUST_LEVELS, written again here: the server stack loads only for serve
_TRUST_LEVELS = ("same-repo", "approved", "all")
# local.sandbox.MODES, for the same reason
_SANDBOX_MODES = ("auto", "bubblewrap", "off")

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")


def _duration(flag: str, text: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise _UsageError(f"{flag} {text!r}: expected a positive duration such as 90s, 12h, 7d")
    unit = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return float(match.group(1)) * unit


def _preview_filter(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("base", "label", "branch") or not value:
            raise _UsageError(
                f"--preview-filter {part!r}: expected base=BRANCH, label=NAME or branch=PATTERN"
            )
        found[key] = value
    return found


def _approve_label(label: str) -> str:
    if not label.strip():
        raise _UsageError("--preview-approve-label: must not be empty")
    return label.strip()


def _preview_secrets_dir(value: str | None, secrets_dir: str | None) -> Path | None:
    """The previews' secrets folder; production's own would hand its secrets to any PR."""
    if not value:
        return None
    path = Path(value).resolve()
    if secrets_dir and Path(secrets_dir).resolve() in (path, *path.parents):
        raise _UsageError(
            f"--preview-secrets-dir {value!r} is in --secrets-dir: previews run code from pull "
            "requests, give them a folder of their own"
        )
    return path


def _kube_settings(args: argparse.Namespace) -> Any:
    from .kube.settings import KubeSettings

    overrides = {
        flag.lstrip("-").replace("-", "_"): getattr(args, flag.lstrip("-").replace("-", "_"))
        for flag, _, _ in _KUBE_FLAGS
    }
    overrides["context"] = overrides.pop("kube_context")
    s3 = {k: overrides.pop(f"s3_{k}") for k in ("endpoint", "bucket", "region")}
    settings = KubeSettings.from_env(os.environ, build_timeout=int(args.build_timeout), **overrides)
    s3_values = {k: v for k, v in s3.items() if v}
    if s3_values:
        settings = dataclasses.replace(settings, s3=dataclasses.replace(settings.s3, **s3_values))
    return settings


def _serve(args: argparse.Namespace) -> int:
    from .access import open_reads_refusal
    from .serve import ServeConfig, Server  # the server stack loads only for this command

    _register_secrets(args)
    _check_repo(args.repo)
    _check_ssh_keys()
    host, sep, port = args.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise _UsageError(f"--listen {args.listen!r}: expected HOST:PORT")
    refusal = open_reads_refusal(
        args.listen,
        host.strip("[]") or "127.0.0.1",
        args.api_token,
        args.read_token,
        args.anonymous_read,
    )
    if refusal:
        raise _UsageError(refusal)
    if not _ENV_NAME.fullmatch(args.env):
        raise _UsageError(f"--env {args.env!r}: must be a DNS-1123 label of at most 40 characters")
    preview_filter = _preview_filter(args.preview_filter)
    config = ServeConfig(
        repo=args.repo,
        state_dir=Path(args.state_dir).resolve(),
        branch=args.branch,
        env=args.env,
        host=host.strip("[]") or "127.0.0.1",
        port=int(port),
        poll_interval=_positive("--poll-interval", args.poll_interval),
        api_token=args.api_token or None,
        read_token=args.read_token or None,
        anonymous_read=args.anonymous_read,
        webhook_secret=args.webhook_secret or None,
        webhook_secrets=_webhook_secrets(args),
        secrets_dir=Path(args.secrets_dir) if args.secrets_dir else None,
        max_builds=int(_positive("--max-builds", args.max_builds)),
        build_timeout=_positive("--build-timeout", args.build_timeout),
        fetch_timeout=_fetch_timeout(args.fetch_timeout),
        log_format=_choice("SLESS_LOG_FORMAT", args.log_format, logs.FORMATS),
        log_level=_choice("SLESS_LOG_LEVEL", args.log_level, logs.LEVELS),
        keep_builds=_not_negative("--keep-builds", args.keep_builds),
        gc_interval=_positive("--gc-interval", args.gc_interval),
        gc_min_age=_seconds("--gc-min-age", args.gc_min_age),
        trusted_proxies=_trusted_proxies(args.trusted_proxies),
        allow_empty=args.allow_empty,
        backend=args.backend,
        sandbox=_choice("SLESS_SANDBOX", args.sandbox, _SANDBOX_MODES),
        kube=_kube_settings(args) if args.backend == "kubernetes" else None,
        previews=args.previews,
        preview_base=preview_filter.get("base"),
        preview_label=preview_filter.get("label"),
        preview_branch=preview_filter.get("branch"),
        max_previews=int(_positive("--max-previews", args.max_previews)),
        preview_ttl=_duration("--preview-ttl", args.preview_ttl),
        preview_trust=_choice("SLESS_PREVIEW_TRUST", args.preview_trust, _TRUST_LEVELS),
        preview_approve_label=_approve_label(args.preview_approve_label),
        preview_secrets_dir=_preview_secrets_dir(args.preview_secrets_dir, args.secrets_dir),
        instance_name=args.instance_name,
        forge_token=os.environ.get("SLESS_FORGE_TOKEN") or None,
        forge_kind=args.forge,
        forge_api=args.forge_api,
    )
    logs.configure(config.log_format, config.log_level)
    if config.backend == "local":
        _check_sandbox(config)
    Server(config).run()
    return EXIT_OK


def _check_sandbox(config: Any) -> None:
    """Probe the sandbox once, before anything starts; previews need one, or trust in all."""
    from .serve import local_sandbox

    sandbox = local_sandbox(config.sandbox)  # SandboxUnavailable: one line, exit 2
    if config.previews and not sandbox.enabled and config.preview_trust != "all":
        raise _UsageError(
            "--previews: pull requests' code would run unconfined on the local backend "
            "(sandbox off); use --sandbox bubblewrap, or --preview-trust all to accept it"
        )


def _report_invalid(state: manifest.DesiredState) -> None:
    for problem in state.problems:
        print(problem, file=sys.stderr)


def _described(snapshot: Snapshot, ref: str | None) -> str:
    """What was read, in words: which files on disk, or which commit."""
    if isinstance(snapshot, DirectorySnapshot):
        tree = snapshot.work_tree
        if tree is None:
            where = f"{snapshot.root}, a plain directory"
        elif tree == snapshot.root:
            where = f"the git work tree {tree}"
        else:
            where = f"{snapshot.root}, in the git work tree {tree}"
        changes = "uncommitted changes included, " if tree else ""
        return f"files on disk in {where}: {changes}ignored files left out"
    return f"commit {snapshot.revision}, " + (
        f"--ref {ref}" if ref else "HEAD of a bare repository"
    )


def _validate(args: argparse.Namespace) -> int:
    snapshot = open_source(args.path, args.ref)
    state = manifest.load(snapshot)
    _report_invalid(state)
    manifests = {fn.manifest for fn in state.functions.values()}
    print(
        f"{len(state.functions)} functions in {len(manifests)} valid manifests, "
        f"{len(state.invalid)} invalid ({_described(snapshot, args.ref)})"
    )
    return EXIT_INVALID if state.invalid else EXIT_OK


def _job_results(pairs: Sequence[str]) -> dict[str, str]:
    results = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise _UsageError(f"--job-result {pair!r}: expected JOB=JSON")
        try:
            json.loads(value)
        except ValueError as exc:
            raise _UsageError(f"--job-result {name}: {value!r} is not JSON") from exc
        results[name] = value
    return results


def _render(args: argparse.Namespace) -> int:
    if not _ENV_NAME.fullmatch(args.env):
        raise _UsageError(f"--env {args.env!r}: must be a DNS-1123 label of at most 40 characters")
    state = manifest.load(open_source(args.path, args.ref))
    _report_invalid(state)
    try:
        gateway = renderer.parse_gateway(args.gateway) if args.gateway else None
    except ValueError as exc:
        raise _UsageError(f"--gateway: {exc}") from exc
    config = renderer.RenderConfig(registry=args.registry, gateway=gateway)
    rendered = renderer.render_environment(
        state, args.env, config, _job_results(args.job_result), builds=not args.no_builds
    )
    for name, jobs in sorted(rendered.waiting.items()):
        print(
            f"# {name}: not rendered, waits for the result of job {', '.join(jobs)}",
            file=sys.stderr,
        )
    sys.stdout.write(renderer.dump(rendered.objects))
    return EXIT_INVALID if state.invalid else EXIT_OK


class _UsageError(Exception):
    pass


# --- talking to a server -------------------------------------------------------------------


def _client(args: argparse.Namespace, timeout: float = 30.0) -> Client:
    try:
        url = server_url(args.server)
    except ValueError as exc:
        raise _UsageError(f"--server {exc}") from None
    return Client(
        url,
        os.environ.get("SLESS_API_TOKEN"),
        timeout=timeout,
        read_token=os.environ.get("SLESS_READ_TOKEN"),
    )


def _colour(stream: TextIO) -> Callable[[str, str], str]:
    """``paint(text, style)``: ANSI colours on a terminal (not with NO_COLOR), else plain."""
    on = stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    codes = {"green": "32", "red": "31", "yellow": "33", "dim": "2", "bold": "1", "cyan": "36"}

    def paint(text: str, style: str) -> str:
        return f"\033[{codes[style]}m{text}\033[0m" if on and style in codes else text

    return paint


_PHASE_STYLE = {
    "Ready": "green",
    "Disabled": "dim",
    "Pending": "yellow",
    "Building": "yellow",
    "Running": "yellow",
    "Failed": "red",
    "Invalid": "red",
    "Degraded": "red",
    "Progressing": "yellow",
    "Succeeded": "green",
}


def _target(value: str, client: Client) -> tuple[str, str]:
    """``ENV/NAME``, or ``NAME`` in the environment the server follows."""
    env, sep, name = value.rpartition("/")
    if not sep:
        env = client.get("/api/v1/status")["environment"]
    for what, label in (("environment", env), ("function", name)):
        if not _ENV_NAME.fullmatch(label):
            raise _UsageError(f"{value!r}: {what} {label!r} is not a DNS-1123 label; use ENV/NAME")
    return env, name


def _short(revision: str | None) -> str:
    return revision[:12] if revision else "-"


def _table(rows: list[list[str]], styles: list[list[str]], paint: Callable[[str, str], str]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row, style in zip(rows, styles, strict=True):
        cells = [
            paint(cell.ljust(width) if i < len(row) - 1 else cell, style[i])
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _message(fn: dict[str, Any]) -> str:
    message = (fn.get("message") or "").strip().splitlines()
    text = message[0] if message else ""
    if fn.get("restarts"):
        text = (text + "; " if text else "") + f"{fn['restarts']} restarts"
        if fn.get("lastExit") and fn["lastExit"] not in text:
            text += f", last: {fn['lastExit']}"
    return text


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.get("/api/v1/status")
        environments = {e["name"]: e for e in client.get("/api/v1/environments")}
        if args.env and args.env not in environments:
            known = ", ".join(sorted(environments)) or "none yet"
            print(
                f"gitops-sless status: the server has no environment {args.env!r} "
                f"(it has: {known})",
                file=sys.stderr,
            )
            return EXIT_NOT_OK
        names = [args.env] if args.env else sorted(environments) or [status["environment"]]
        listing = []
        for name in names:
            functions = client.get(f"/api/v1/environments/{segment(name)}/functions")
            last = environments.get(name, {}).get("lastSync")
            listing.append({"name": name, "lastSync": last, "functions": functions})
    ok = all(fn["phase"] in GOOD_PHASES for env in listing for fn in env["functions"]) and not any(
        env["lastSync"] and env["lastSync"]["result"] in NOT_CONVERGED for env in listing
    )
    if args.output == "json":
        answer = {"server": client.server, "ok": ok, "status": status, "environments": listing}
        print(json.dumps(answer, indent=2))
        return EXIT_OK if ok else EXIT_NOT_OK
    paint = _colour(sys.stdout)
    print(
        f"{client.server}: {status['repository']} ({status['branch']}), "
        f"last good revision {_short(status['lastGoodRevision'])}"
    )
    for env in listing:
        last = env["lastSync"]
        if last:
            error = f": {last['error'].splitlines()[0]}" if last["error"] else ""
            print(
                f"\n{paint(env['name'], 'bold')}: last sync "
                f"{paint(last['result'], _PHASE_STYLE.get(last['result'], ''))} at "
                f"{_short(last['revision'])} ({last['trigger']}, "
                f"{last['finished'] or last['started']}){error}"
            )
        else:
            print(f"\n{paint(env['name'], 'bold')}: no sync yet")
        if not env["functions"]:
            print("  no functions")
            continue
        rows = [["NAME", "PHASE", "REVISION", "BUILD", "MESSAGE"]]
        styles = [["dim"] * 5]
        for fn in env["functions"]:
            rows.append(
                [
                    fn["name"],
                    fn["phase"],
                    _short(fn["revision"]),
                    fn["buildTag"] or "-",
                    _message(fn),
                ]
            )
            styles.append(["", _PHASE_STYLE.get(fn["phase"], ""), "", "", ""])
        if sys.stdout.isatty():  # one line per function on a terminal
            width = shutil.get_terminal_size().columns
            prefix = sum(max(len(row[i]) for row in rows) + 2 for i in range(4))
            for row in rows:
                room = max(width - prefix, 20)
                row[4] = row[4] if len(row[4]) <= room else row[4][: room - 1] + "…"
        print(_table(rows, styles, paint))
    return EXIT_OK if ok else EXIT_NOT_OK


# --- diff -----------------------------------------------------------------------------------------


def _diff(args: argparse.Namespace) -> int:
    from .api_models import DiffRequest  # pydantic: loaded for this command only

    snapshot = open_source(args.path, args.ref)
    state = manifest.load(snapshot)
    body = DiffRequest.from_state(state).model_dump(mode="json", by_alias=True)
    with _client(args, timeout=120.0) as client:
        env = args.env or client.get("/api/v1/status")["environment"]
        if not _ENV_NAME.fullmatch(env):
            raise _UsageError(f"--env {env!r}: must be a DNS-1123 label of at most 40 characters")
        answer = client.api("POST", f"/api/v1/environments/{segment(env)}/diff", json=body)
    if args.output == "json":
        print(json.dumps(answer, indent=2))
    else:
        _print_diff(answer, f"{_described(snapshot, args.ref)}; {env} on {client.server}")
    return EXIT_NOT_OK if answer["hasChanges"] else EXIT_OK


def _print_diff(answer: dict[str, Any], what: str) -> None:
    paint = _colour(sys.stdout)
    out: list[str] = [paint(f"diff of {what}", "dim")]
    for build in answer["builds"]:
        failed = f" (its last build failed: {build['lastError']})" if build["lastError"] else ""
        out.append(
            f"{paint('build', 'cyan')}     {build['tag']}  {build['folder'] or '.'}: "
            f"{', '.join(build['functions'])}{failed}"
        )
    for fn in answer["added"]:
        note = f" ({fn['note']})" if fn["note"] else ""
        out.append(f"{paint('+ added', 'green')}   {fn['name']}  {fn['buildTag']}{note}")
    for fn in answer["changed"]:
        out.append(f"{paint('~ changed', 'yellow')} {fn['name']}")
        for field in fn["fields"]:
            if (
                field["old"] is not None
                and field["new"] is not None
                and field["old"] != field["new"]
            ):
                values = f"{field['old']} -> {field['new']}"
            else:
                values = field["new"] or field["old"] or ""
            detail = f" ({field['detail']})" if field["detail"] else ""
            out.append(f"    {field['field']}: {values}{detail}".rstrip())
    for name in answer["removed"]:
        out.append(f"{paint('- removed', 'red')} {name}")
    for job in answer["jobs"]:
        after = f", after {job['after']}" if job["after"] else ""
        state = f" ({job['phase']})" if job["phase"] else ""
        out.append(
            f"{paint('job', 'cyan')}       {job['name']} run {job['runId']} of {job['function']}"
            f"{after}{state}"
        )
    for invalid in answer["invalid"]:
        names = ", ".join(invalid["functions"])
        keeps = f": keeps the last good version of {names} (Invalid)" if names else ""
        out.append(f"{paint('! invalid', 'red')} {invalid['manifest']}{keeps}")
        out.extend(f"    {problem}" for problem in invalid["problems"])
    for waiting in answer["waiting"]:
        out.append(f"{paint('waiting', 'yellow')}   {waiting['name']}: {waiting['reason']}")
    counts = [
        (len(answer["builds"]), "build"),
        (len(answer["added"]), "added"),
        (len(answer["changed"]), "changed"),
        (len(answer["removed"]), "removed"),
        (len(answer["jobs"]), "job run"),
        (len(answer["invalid"]), "invalid manifest"),
    ]
    said = [
        f"{n} {word}{'s' if n > 1 and word in ('build', 'job run', 'invalid manifest') else ''}"
        for n, word in counts
        if n
    ]
    unchanged = len(answer["unchanged"])
    if said:
        out.append(f"changes: {', '.join(said)}; {unchanged} unchanged")
    else:
        out.append(f"no changes: {unchanged} functions up to date")
    print("\n".join(out))


# --- logs -----------------------------------------------------------------------------------------


def _write(text: str) -> None:
    sys.stdout.buffer.write(text.encode("utf-8", "replace"))
    sys.stdout.buffer.flush()


def _chunks(client: Client, path: str, follow: bool) -> Iterator[dict[str, Any]]:
    """Pages of a log from its start; with ``follow``, new ones as they are written."""
    offset = 0
    while True:
        chunk = client.get(path, offset=offset)
        yield chunk
        progressed = chunk["reset"] or chunk["nextOffset"] != offset
        offset = chunk["nextOffset"]
        if progressed and offset < chunk["size"]:
            continue  # more is there already
        if not follow or chunk["finished"]:
            return
        time.sleep(POLL_SEC)


def _print_log(client: Client, path: str, follow: bool) -> int:
    for chunk in _chunks(client, path, follow):
        if chunk["reset"]:
            print("--- the log was cut; reading from its start ---", file=sys.stderr, flush=True)
        if chunk["text"]:
            _write(chunk["text"])
    return EXIT_OK


def _run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    return (run["runId"], run["phase"], run["attempts"], run["finished"])


def _print_run(run: dict[str, Any], paint: Callable[[str, str], str]) -> None:
    when = " -> ".join(t for t in (run["started"], run["finished"]) if t) or "not started"
    attempts = f"attempt {run['attempts']}, " if run["attempts"] else ""
    phase = paint(run["phase"], _PHASE_STYLE.get(run["phase"], ""))
    lines = [f"{run['name']} run {run['runId']}: {phase} ({attempts}{when})"]
    if run["result"] is not None:
        try:
            lines.append(json.dumps(json.loads(run["result"]), indent=2))
        except ValueError:
            lines.append(run["result"])
    if run["error"]:
        lines.append(run["error"])
    _write("\n".join(lines) + "\n")


def _print_job(client: Client, env: str, name: str, job: str, follow: bool) -> int:
    paint = _colour(sys.stdout)
    seen: dict[int, tuple[Any, ...]] = {}
    while True:
        runs = [
            r for r in client.get(f"/api/v1/environments/{segment(env)}/jobs") if r["name"] == job
        ]
        if not seen and runs and runs[0]["function"] != name:
            print(
                f"gitops-sless logs: job {job!r} belongs to function {runs[0]['function']!r}, "
                f"not {name!r}",
                file=sys.stderr,
            )
            return EXIT_NOT_OK
        if not seen and not runs and not follow:
            detail = client.get(f"/api/v1/environments/{segment(env)}/functions/{segment(name)}")
            ran = sorted({run["name"] for run in detail["jobs"]})
            known = f" (runs of {', '.join(ran)} are)" if ran else ""
            print(f"gitops-sless logs: job {job!r} has no runs in {env}{known}", file=sys.stderr)
            return EXIT_NOT_OK
        for run in sorted(runs, key=lambda r: r["runId"]):
            if seen.get(run["runId"]) != _run_key(run):
                seen[run["runId"]] = _run_key(run)
                _print_run(run, paint)
        if not follow:
            return EXIT_OK
        time.sleep(POLL_SEC)


def _logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        env, name = _target(args.function, client)
        try:
            if args.job:
                return _print_job(client, env, name, args.job, args.follow)
            where = f"/api/v1/environments/{segment(env)}/functions/{segment(name)}"
            if not args.build:
                return _print_log(client, f"{where}/logs", args.follow)
            tag = client.get(where)["buildTag"]
            if not tag:
                print(f"gitops-sless logs: {env}/{name} has no build yet", file=sys.stderr)
                return EXIT_NOT_OK
            return _print_log(client, f"/api/v1/builds/{segment(tag)}/log", args.follow)
        except NotFound as exc:
            print(f"gitops-sless logs: {exc}", file=sys.stderr)
            return EXIT_NOT_OK


# --- invoke ---------------------------------------------------------------------------------------


def _body(data: str | None) -> bytes | None:
    if data is None:
        return None
    if data == "@-":
        return sys.stdin.buffer.read()
    if data.startswith("@"):
        try:
            return Path(data[1:]).read_bytes()
        except OSError as exc:
            raise _UsageError(f"--data {data}: {exc.strerror or exc}") from None
    return data.encode()


def _headers(pairs: Sequence[str], body: bytes | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name.strip()):
            raise _UsageError(f"--header {pair!r}: expected 'NAME: VALUE'")
        headers[name.strip()] = value.strip()
    if body is not None and not any(k.lower() == "content-type" for k in headers):
        try:
            json.loads(body)
            headers["Content-Type"] = "application/json"
        except ValueError:
            headers["Content-Type"] = "text/plain; charset=utf-8"
    return headers


def _invoke(args: argparse.Namespace) -> int:
    body = _body(args.data)
    headers = _headers(args.header, body)
    method = (args.method or ("POST" if body is not None else "GET")).upper()
    if not re.fullmatch(r"[A-Z]+", method):
        raise _UsageError(f"-X {args.method!r}: not an HTTP method")
    sub = args.path if args.path.startswith("/") else "/" + args.path
    with _client(args) as client:
        env, name = _target(args.function, client)
        started = time.monotonic()
        response = client.invoke(
            method,
            f"/fn/{segment(env)}/{segment(name)}{sub}",
            content=body,
            headers=headers,
            timeout=_positive("--timeout", args.timeout),
        )
    took = (time.monotonic() - started) * 1000
    content = response.content
    sys.stdout.buffer.write(content)
    if content and not content.endswith(b"\n") and sys.stdout.isatty():
        sys.stdout.buffer.write(b"\n")
    sys.stdout.buffer.flush()
    request_id = response.headers.get("x-request-id")
    print(
        f"{response.status_code} {response.reason_phrase} in {took:.0f} ms"
        + (f", request id {request_id}" if request_id else ""),
        file=sys.stderr,
    )
    return EXIT_OK if response.is_success else EXIT_NOT_OK


# --- sync -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _progress(what: str) -> Iterator[None]:
    """A line that counts seconds on a terminal's stderr while the block runs."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while True:
            sys.stderr.write(f"\r{what}… {time.monotonic() - started:.0f}s")
            sys.stderr.flush()
            if done.wait(0.2):
                return

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def _sync(args: argparse.Namespace) -> int:
    wait = args.wait
    if not 0 <= wait <= MAX_SYNC_WAIT:
        raise _UsageError(f"--wait {wait:g}: must be 0 to {MAX_SYNC_WAIT}")
    with _client(args) as client, _progress("syncing"):
        answer = client.api("POST", "/api/v1/sync", params={"wait": wait}, timeout=wait + 30)
    if wait == 0:
        print("sync requested: the pass runs in the background (gitops-sless status shows it)")
        return EXIT_OK
    if not answer["finished"]:
        print(
            f"gitops-sless sync: the pass did not finish within {wait:g} s; it goes on "
            "(gitops-sless status shows it)",
            file=sys.stderr,
        )
        return EXIT_NOT_OK
    last = answer["lastSync"]
    if last is None:
        print("gitops-sless sync: the server recorded no pass", file=sys.stderr)
        return EXIT_NOT_OK
    paint = _colour(sys.stdout)
    error = f": {last['error']}" if last["error"] else ""
    print(
        f"{paint(last['result'], _PHASE_STYLE.get(last['result'], ''))} at "
        f"{_short(last['revision'])}{error}"
    )
    return EXIT_OK if last["result"] == "Succeeded" else EXIT_NOT_OK


# --- shell completion --------------------------------------------------------------------------


def _complete(argv: Sequence[str]) -> int:
    """``__complete envs|functions [--server URL]``: names for the shell, quietly."""
    server = None
    if "--server" in argv[:-1]:
        server = argv[list(argv).index("--server") + 1]
    try:
        tokens = os.environ.get("SLESS_API_TOKEN"), os.environ.get("SLESS_READ_TOKEN")
        with Client(server_url(server), tokens[0], timeout=2, read_token=tokens[1]) as client:
            envs = [e["name"] for e in client.get("/api/v1/environments")]
            if argv[:1] == ["envs"]:
                print("\n".join(envs))
                return EXIT_OK
            for env in envs:
                for fn in client.get(f"/api/v1/environments/{segment(env)}/functions"):
                    print(f"{env}/{fn['name']}")
    except (ClientError, ValueError, KeyError, TypeError):
        return EXIT_ERROR
    return EXIT_OK


# what the value of an option or positional completes to, by its dest: a kind, or choices
_DIRS = ("path", "state_dir", "secrets_dir")
_NAMES = {"function": "functions"}


def _value_kind(action: argparse.Action, talks_to_server: bool) -> str | list[str]:
    if action.choices:
        return [str(choice) for choice in action.choices]
    if action.dest in _DIRS and (action.dest != "path" or not action.option_strings):
        return "dirs"
    if action.dest in _NAMES:
        return _NAMES[action.dest]
    if action.dest == "env" and talks_to_server:
        return "envs"
    if action.dest in ("data", "repo"):
        return "files"
    return "none"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def _bash_script(parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    cases = []
    for name, sub in commands.items():
        server = any("--server" in a.option_strings for a in sub._actions)
        options, values, positional = [], [], "none"
        for action in sub._actions:
            if not action.option_strings:
                kind = _value_kind(action, server)
                positional = kind if isinstance(kind, str) else "words:" + " ".join(kind)
                continue
            options += action.option_strings
            if action.nargs != 0:
                kind = _value_kind(action, server)
                word = kind if isinstance(kind, str) else "words:" + " ".join(kind)
                values.append(f"            {'|'.join(action.option_strings)}) kind='{word}' ;;")
        cases.append(
            f"        {name})\n"
            f"            options='{' '.join(options)}'\n"
            f"            positional='{positional}'\n"
            f'            case "$prev" in\n' + "\n".join(values) + "\n            esac ;;"
        )
    return (
        _BASH_TEMPLATE.replace("@COMMANDS@", " ".join(commands))
        .replace("@CASES@", "\n".join(cases))
        .lstrip()
    )


_BASH_TEMPLATE = r"""
# bash completion for gitops-sless
#   source <(gitops-sless completion bash)      # now, or from ~/.bashrc
# ENV/NAME and --env values come from the server (--server or $SLESS_SERVER).
_gitops_sless_names() {
    local server=""
    if [[ $COMP_LINE =~ --server[=\ ]+([^ ]+) ]]; then server=${BASH_REMATCH[1]}; fi
    "${COMP_WORDS[0]}" __complete "$1" ${server:+--server "$server"} 2>/dev/null
}

_gitops_sless() {
    local cur prev cmd="" i
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"
    for ((i = 1; i < COMP_CWORD; i++)); do
        if [[ ${COMP_WORDS[i]} != -* ]]; then cmd="${COMP_WORDS[i]}"; break; fi
    done
    if [[ -z $cmd ]]; then
        COMPREPLY=($(compgen -W "@COMMANDS@ --version --help" -- "$cur"))
        return
    fi
    local options="" positional="none" kind=""
    case "$cmd" in
@CASES@
        *) return ;;
    esac
    if [[ -z $kind ]]; then
        if [[ $cur == -* ]]; then
            COMPREPLY=($(compgen -W "$options" -- "$cur"))
            return
        fi
        kind=$positional
    fi
    case "$kind" in
        dirs) COMPREPLY=($(compgen -d -- "$cur")) ;;
        files) COMPREPLY=($(compgen -f -- "$cur")) ;;
        envs | functions) COMPREPLY=($(compgen -W "$(_gitops_sless_names "$kind")" -- "$cur")) ;;
        words:*) COMPREPLY=($(compgen -W "${kind#words:}" -- "$cur")) ;;
        *) COMPREPLY=() ;;
    esac
}

complete -o default -F _gitops_sless gitops-sless
"""


def _zsh_quote(text: str) -> str:
    """Text for a single-quoted zsh _arguments spec: brackets and quotes escaped."""
    text = " ".join(text.split())
    return text.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]").replace("'", "'\\''")


_ZSH_ACTIONS = {
    "dirs": "_files -/",
    "files": "_files",
    "envs": "_gitops_sless_envs",
    "functions": "_gitops_sless_functions",
    "none": " ",
}


def _zsh_action(kind: str | list[str]) -> str:
    return f"({' '.join(kind)})" if isinstance(kind, list) else _ZSH_ACTIONS[kind]


def _zsh_script(parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    helps = _helps(parser)
    described = "\n".join(
        "    '{}:{}'".format(name, _zsh_quote(helps.get(name, "")).replace(":", "\\:"))
        for name in commands
    )
    cases = []
    for name, sub in commands.items():
        server = any("--server" in a.option_strings for a in sub._actions)
        specs = []
        for action in sub._actions:
            kind = _value_kind(action, server)
            help_text = _zsh_quote(
                (action.help or "")
                .replace("%(default)s", str(action.default))
                .replace("%(default)g", str(action.default))
            )
            if not action.option_strings:
                label = (action.metavar or action.dest).replace(":", "")
                specs.append(f"'1:{label}:{_zsh_action(kind)}'")
                continue
            flags = action.option_strings
            exclusive = f"({' '.join(flags)})" if len(flags) > 1 else ""
            names = flags[0] if len(flags) == 1 else "{" + ",".join(flags) + "}"
            value = ""
            if action.nargs != 0:
                label = str(action.metavar or action.dest).replace(":", "").replace("'", "")
                value = f":{label}:{_zsh_action(kind)}"
            repeat = "*" if isinstance(action, argparse._AppendAction) else ""
            prefix = f"'{repeat or exclusive}'" if (repeat or exclusive) else ""
            specs.append(f"{prefix}{names}'[{help_text}]{value}'")
        body = " \\\n                ".join(specs)
        cases.append(f"            {name})\n                _arguments {body} ;;")
    return (
        _ZSH_TEMPLATE.replace("@DESCRIBED@", described)
        .replace("@CASES@", "\n".join(cases))
        .lstrip()
    )


_ZSH_TEMPLATE = r"""
#compdef gitops-sless
# zsh completion for gitops-sless
#   source <(gitops-sless completion zsh)       # now, or from ~/.zshrc after compinit
#   gitops-sless completion zsh > "${fpath[1]}/_gitops-sless"   # or install it
# ENV/NAME and --env values come from the server (--server or $SLESS_SERVER).

_gitops_sless_names() {
    local server=${opt_args[--server]}
    "$_gitops_sless_program" __complete "$1" ${server:+--server "$server"} 2>/dev/null
}

_gitops_sless_envs() {
    local -a names
    names=(${(f)"$(_gitops_sless_names envs)"})
    _describe -t environments 'environment' names
}

_gitops_sless_functions() {
    local -a names
    names=(${(f)"$(_gitops_sless_names functions)"})
    _describe -t functions 'function' names
}

_gitops_sless() {
    local curcontext="$curcontext" state line _gitops_sless_program=$words[1]
    typeset -A opt_args
    _arguments -C \
        '(- *)--version[print the version]' \
        '(- *)'{-h,--help}'[show help]' \
        '1:command:->command' \
        '*::argument:->argument'
    case $state in
        command)
            local -a commands
            commands=(
@DESCRIBED@
            )
            _describe -t commands 'gitops-sless command' commands
            ;;
        argument)
            case $words[1] in
@CASES@
            esac
            ;;
    esac
}

if [[ $funcstack[1] == _gitops-sless ]]; then
    _gitops_sless "$@"
else
    compdef _gitops_sless gitops-sless
fi
"""


def _completion(args: argparse.Namespace) -> int:
    script = _bash_script(_parser()) if args.shell == "bash" else _zsh_script(_parser())
    sys.stdout.write(script)
    return EXIT_OK


def _add_import_command(commands: Any) -> None:
    sources = commands.add_parser(
        "import", help="turn another tool's configuration into a repository"
    )
    kinds = sources.add_subparsers(dest="source", required=True)
    terraform = kinds.add_parser(
        "terraform", help="the sless Terraform provider's .tf files and code as a repository"
    )
    terraform.add_argument("path", help="the Terraform directory (*.tf, terraform.tfvars)")
    terraform.add_argument(
        "--out", metavar="REPO_DIR", help="where to write the repository (default: PATH-sless)"
    )
    terraform.add_argument(
        "--secrets-dir", help="write secret values here as serve --secrets-dir reads them"
    )
    terraform.add_argument(
        "--force", action="store_true", help="write into a non-empty --out, and despite refusals"
    )


def _import(args: argparse.Namespace) -> int:
    from .tfimport import Refusal, import_terraform  # loads the HCL parser only when asked

    source = Path(args.path)
    out = (
        Path(args.out) if args.out else source.resolve().with_name(source.resolve().name + "-sless")
    )
    secrets = Path(args.secrets_dir) if args.secrets_dir else None
    try:
        report = import_terraform(source, out, secrets_dir=secrets, force=args.force)
    except Refusal as exc:
        print("\n".join(exc.lines), file=sys.stderr)
        print("nothing written (--force writes what can be converted)", file=sys.stderr)
        return EXIT_NOT_OK
    print("\n".join(report.lines))
    return EXIT_OK if report.complete else EXIT_NOT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["__complete"]:
        return _complete(argv[1:])
    args = _parser().parse_args(argv)
    handlers = {
        "validate": _validate,
        "render": _render,
        "serve": _serve,
        "status": _status,
        "diff": _diff,
        "logs": _logs,
        "invoke": _invoke,
        "sync": _sync,
        "completion": _completion,
        "import": _import,
    }
    try:
        return handlers[args.command](args)
    except (_UsageError, SlessError) as exc:
        print(f"gitops-sless {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ClientError as exc:
        print(f"gitops-sless {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # | head: the reader has what it wanted
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - no flush error at exit
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
