"""``gitops-sless serve``: its flags, checked before anything starts, then the server.

A flag or environment variable that cannot work is one line and exit 2 before any
file is written; the server stack (FastAPI, uvicorn, the backends) loads only here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import math
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .. import logs
from ..errordetail import ErrorDetails
from .common import EXIT_OK, UsageError, check_env, exit_epilog, positive
from .flaggroups import (
    KUBE_FLAGS,
    TRUST_LEVELS,
    add_async_flags,
    add_kube_flags,
    add_notify_flags,
    add_preview_flags,
    add_scaling_flags,
    add_tracing_flags,
    duration,
    env_choice,
    otlp_endpoint,
    trace_url_template,
)

__all__ = ["TRUST_LEVELS", "add_parser"]

# webhooks.FORGES, named here so that a command other than serve loads no pydantic
WEBHOOK_FORGES = ("github", "gitea", "gitlab")
# local.sandbox.MODES, for the same reason
_SANDBOX_MODES = ("auto", "bubblewrap", "off")


def add_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="follow a repository, build what changed, run it locally, proxy /fn/",
        epilog=exit_epilog("serve"),
    )
    serve.set_defaults(run=_serve)
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
        "--fn-listen",
        default=os.environ.get("SLESS_FN_LISTEN") or None,
        metavar="HOST:PORT",
        help="serve /fn/ (and /healthz) on this address alone, and not on --listen: "
        "functions' pages then have an origin of their own, apart from the dashboard's and "
        "the API's (default: $SLESS_FN_LISTEN; none: /fn/ on --listen)",
    )
    serve.add_argument(
        "--state-dir",
        default=os.environ.get("SLESS_STATE_DIR") or ".sless-state",
        help="status store, artifacts, logs, the generated API token "
        "(default: $SLESS_STATE_DIR or .sless-state)",
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
        default=env_choice("SLESS_SANDBOX", "auto"),
        help="local backend: every function process and installer in a bubblewrap sandbox: "
        "auto (where bubblewrap works, else unconfined, with a warning), bubblewrap (or refuse "
        "to start), off (default: $SLESS_SANDBOX or auto)",
    )
    serve.add_argument(
        "--allow-empty",
        action="store_true",
        help="let a commit that declares no function prune every function (Argo CD's allowEmpty)",
    )
    add_kube_flags(serve)
    add_preview_flags(serve)
    add_scaling_flags(serve)
    add_async_flags(serve)
    add_notify_flags(serve)
    serve.add_argument(
        "--fetch-timeout",
        type=float,
        metavar="SECONDS",
        help="overall deadline of one fetch of the repository; a fetch still running then is "
        "abandoned and the next pass tries again (default: $SLESS_FETCH_TIMEOUT or 120)",
    )
    serve.add_argument(
        "--ssh-known-hosts",
        default=os.environ.get("SLESS_SSH_KNOWN_HOSTS") or None,
        metavar="PATH",
        help="OpenSSH known_hosts file with the host keys an ssh:// --repo may present; a fetch "
        "from a server whose key it does not hold is refused (default: $SLESS_SSH_KNOWN_HOSTS, "
        "else ~/.ssh/known_hosts if it exists; none: every ssh:// fetch is refused)",
    )
    serve.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=env_choice("SLESS_LOG_FORMAT", "text"),
        help="one line per event as text or JSON (default: $SLESS_LOG_FORMAT or text)",
    )
    serve.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        default=env_choice("SLESS_LOG_LEVEL", "info"),
        help="least severe level logged (default: $SLESS_LOG_LEVEL or info)",
    )
    add_tracing_flags(serve)
    serve.add_argument(
        "--keep-builds",
        type=int,
        default=3,
        metavar="N",
        help="builds kept per function folder beyond those an environment uses (default: 3)",
    )
    serve.add_argument(
        "--keep-revisions",
        type=int,
        default=5,
        metavar="N",
        help="revisions of each function kept runnable, the one serving included: each "
        "has its own URL (/fn/ENV/NAME@rN/) and a rollback can switch to it (default: 5)",
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
    serve.add_argument(
        "--error-details",
        default=os.environ.get("SLESS_ERROR_DETAILS") or "previews",
        metavar="ENVS",
        help="environments whose callers read a handler's exception in its 500: 'previews', "
        "'all', 'none' or environment names, comma-separated; elsewhere the 500 says only "
        "the request id, and the exception is in the function's log "
        "(default: $SLESS_ERROR_DETAILS or previews)",
    )


def _deadline(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name} {value:g}: must be a number of seconds greater than 0")
    return value


def _fetch_timeout(value: float | None) -> float:
    """``--fetch-timeout``, else ``$SLESS_FETCH_TIMEOUT``, else 120 seconds."""
    if value is not None:
        return _deadline("--fetch-timeout", value)
    text = os.environ.get("SLESS_FETCH_TIMEOUT") or "120"
    try:
        seconds = float(text)
    except ValueError:
        raise UsageError(f"$SLESS_FETCH_TIMEOUT {text!r}: not a number of seconds") from None
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
        raise UsageError(f"--repo {repo}: no such file or directory; {_REPO_EXPECTED}")
    if not path.is_dir():
        raise UsageError(f"--repo {repo}: not a directory; {_REPO_EXPECTED}")


def _check_ssh_keys() -> None:
    for variable in ("SLESS_GIT_SSH_KEY", "SLESS_GIT_SSH_PUBKEY"):
        value = os.environ.get(variable)
        if value and not Path(value).is_file():
            raise UsageError(f"${variable} {value}: no such file; expected an SSH key file")


def _ssh_known_hosts(value: str | None) -> Path | None:
    """The known-hosts file given, which must exist; else ~/.ssh/known_hosts if it does."""
    if not value:
        default = Path("~/.ssh/known_hosts").expanduser()
        return default if default.is_file() else None
    path = Path(value).expanduser()
    if not path.is_file():
        raise UsageError(
            f"--ssh-known-hosts {value}: no such file; expected an OpenSSH known_hosts file "
            "(ssh-keyscan -p PORT HOST > FILE, then check the fingerprints)"
        )
    return path.resolve()


def _seconds(name: str, value: float) -> float:
    if not value >= 0:
        raise UsageError(f"{name} {value:g}: must be 0 or more")
    return value


def _not_negative(name: str, value: int) -> int:
    if value < 0:
        raise UsageError(f"{name} {value}: must be 0 or more")
    return value


def _at_least_one(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} {value}: must be 1 or more (the revision serving is kept)")
    return value


def _choice(env: str, value: str, choices: Sequence[str]) -> str:
    """A choice from the environment (argparse has checked the command line's)."""
    if value not in choices:
        raise UsageError(f"${env} {value!r}: use one of {', '.join(choices)}")
    return value


def _queue(value: str | None, backend: str) -> str | None:
    from ..serve.queue import queue_refusal

    refused = queue_refusal(value, backend)
    if refused is not None:
        raise UsageError(refused)
    return value


def _error_details(value: str) -> ErrorDetails:
    try:
        return ErrorDetails.parse(value)
    except ValueError as exc:
        raise UsageError(f"--error-details {value!r}: {exc}") from None


def _networks(flag: str, value: str) -> tuple[str, ...]:
    networks = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        try:
            networks.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError as exc:
            raise UsageError(f"{flag} {item!r}: not an IP network (CIDR)") from exc
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


def _windows(args: argparse.Namespace) -> Any:
    from ..scaling.autoscaler import Windows

    stable = duration("--scale-window", args.scale_window)
    panic = duration("--scale-panic-window", args.scale_panic_window)
    if panic > stable:
        raise UsageError(
            f"--scale-panic-window {args.scale_panic_window}: longer than --scale-window "
            f"{args.scale_window} (the panic window is the short one)"
        )
    return Windows(stable, panic, duration("--scale-tick", args.scale_tick))


def _preview_filter(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("base", "label", "branch") or not value:
            raise UsageError(
                f"--preview-filter {part!r}: expected base=BRANCH, label=NAME or branch=PATTERN"
            )
        found[key] = value
    return found


def _approve_label(label: str) -> str:
    if not label.strip():
        raise UsageError("--preview-approve-label: must not be empty")
    return label.strip()


def _preview_secrets_dir(value: str | None, secrets_dir: str | None) -> Path | None:
    """The previews' secrets folder; production's own would hand its secrets to any PR."""
    if not value:
        return None
    path = Path(value).resolve()
    if secrets_dir and Path(secrets_dir).resolve() in (path, *path.parents):
        raise UsageError(
            f"--preview-secrets-dir {value!r} is in --secrets-dir: previews run code from pull "
            "requests, give them a folder of their own"
        )
    return path


def _notify_config(value: str | None, secrets_dir: str | None) -> Path | None:
    """The file, once it is known to be usable: a bad one is a usage error, not a crash."""
    if not value:
        return None
    from ..notify import NotifyConfigError, load

    try:
        load(Path(value), Path(secrets_dir) if secrets_dir else None)
    except NotifyConfigError as exc:
        raise UsageError(f"--notify-config: {exc}") from None
    return Path(value)


def _kube_settings(args: argparse.Namespace) -> Any:
    from ..kube.settings import KubeSettings

    overrides = {
        flag.lstrip("-").replace("-", "_"): getattr(args, flag.lstrip("-").replace("-", "_"))
        for flag, _, _ in KUBE_FLAGS
    }
    overrides["context"] = overrides.pop("kube_context")
    s3 = {k: overrides.pop(f"s3_{k}") for k in ("endpoint", "bucket", "region")}
    settings = KubeSettings.from_env(
        os.environ,
        build_timeout=int(args.build_timeout),
        error_details=_error_details(args.error_details),
        otlp_endpoint=otlp_endpoint(args.otlp_endpoint),
        **overrides,
    )
    s3_values = {k: v for k, v in s3.items() if v}
    if s3_values:
        settings = dataclasses.replace(settings, s3=dataclasses.replace(settings.s3, **s3_values))
    return settings


def _address(flag: str, value: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT flag; an empty host is 127.0.0.1."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag} {value!r}: expected HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def _fn_listen(args: argparse.Namespace, listen: tuple[str, int]) -> tuple[str, int] | None:
    if not args.fn_listen:
        return None
    found = _address("--fn-listen", args.fn_listen)
    if found == listen:
        raise UsageError(
            f"--fn-listen {args.fn_listen!r} is --listen's address: give functions another "
            "port (or host)"
        )
    return found


def _generated_token(config: Any) -> Any:
    """``config`` with the token of its state folder when it runs functions on this machine
    (the local backend) and none is configured: its functions share the loopback."""
    from ..web import tokenfile

    if config.backend != "local" or config.api_token or config.read_token:
        return config
    try:
        token = tokenfile.load_or_create(config.state_dir)
    except (tokenfile.TokenFileError, OSError) as exc:
        raise UsageError(f"--state-dir {config.state_dir}: {exc}") from None
    logs.register_secret(token)
    return dataclasses.replace(
        config, api_token=token, token_file=config.state_dir / tokenfile.NAME
    )


def _serve(args: argparse.Namespace) -> int:
    with _restart_signal_held():
        return _start(args)


@contextlib.contextmanager
def _restart_signal_held() -> Iterator[None]:
    """SIGUSR2 restarts serve in place; until the server takes it (serve.restart), one
    that comes while the stack loads is ignored rather than ending the process. Given
    back as it was afterwards: an ignored signal is inherited by every process started
    later (a shell cannot even trap it), and ``main`` may run in a longer-lived process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR2, previous)


def _start(args: argparse.Namespace) -> int:
    from ..serve import ServeConfig, Server  # the server stack loads only for this command
    from ..web.access import open_reads_refusal

    _register_secrets(args)
    _check_repo(args.repo)
    _check_ssh_keys()
    host, port = _address("--listen", args.listen)
    fn_listen = _fn_listen(args, (host, port))
    refusal = open_reads_refusal(
        args.listen, host, args.api_token, args.read_token, args.anonymous_read
    )
    if refusal:
        raise UsageError(refusal)
    check_env("--env", args.env)
    preview_filter = _preview_filter(args.preview_filter)
    config = ServeConfig(
        repo=args.repo,
        state_dir=Path(args.state_dir).resolve(),
        branch=args.branch,
        env=args.env,
        host=host,
        port=port,
        fn_listen=fn_listen,
        poll_interval=positive("--poll-interval", args.poll_interval),
        api_token=args.api_token or None,
        read_token=args.read_token or None,
        anonymous_read=args.anonymous_read,
        webhook_secret=args.webhook_secret or None,
        webhook_secrets=_webhook_secrets(args),
        secrets_dir=Path(args.secrets_dir) if args.secrets_dir else None,
        max_builds=int(positive("--max-builds", args.max_builds)),
        build_timeout=positive("--build-timeout", args.build_timeout),
        fetch_timeout=_fetch_timeout(args.fetch_timeout),
        ssh_known_hosts=_ssh_known_hosts(args.ssh_known_hosts),
        log_format=_choice("SLESS_LOG_FORMAT", args.log_format, logs.FORMATS),
        log_level=_choice("SLESS_LOG_LEVEL", args.log_level, logs.LEVELS),
        keep_builds=_not_negative("--keep-builds", args.keep_builds),
        keep_revisions=_at_least_one("--keep-revisions", args.keep_revisions),
        otlp_endpoint=otlp_endpoint(args.otlp_endpoint),
        service_name=os.environ.get("OTEL_SERVICE_NAME") or "gitops-sless",
        trace_url_template=trace_url_template(args.trace_url_template),
        gc_interval=positive("--gc-interval", args.gc_interval),
        gc_min_age=_seconds("--gc-min-age", args.gc_min_age),
        trusted_proxies=_networks("--trusted-proxies", args.trusted_proxies),
        allow_empty=args.allow_empty,
        backend=args.backend,
        sandbox=_choice("SLESS_SANDBOX", args.sandbox, _SANDBOX_MODES),
        kube=_kube_settings(args) if args.backend == "kubernetes" else None,
        previews=args.previews,
        preview_base=preview_filter.get("base"),
        preview_label=preview_filter.get("label"),
        preview_branch=preview_filter.get("branch"),
        max_previews=int(positive("--max-previews", args.max_previews)),
        preview_ttl=duration("--preview-ttl", args.preview_ttl),
        preview_trust=_choice("SLESS_PREVIEW_TRUST", args.preview_trust, TRUST_LEVELS),
        preview_approve_label=_approve_label(args.preview_approve_label),
        preview_secrets_dir=_preview_secrets_dir(args.preview_secrets_dir, args.secrets_dir),
        instance_name=args.instance_name,
        forge_token=os.environ.get("SLESS_FORGE_TOKEN") or None,
        forge_kind=args.forge,
        forge_api=args.forge_api,
        scale_windows=_windows(args),
        queue=_queue(args.queue, args.backend),
        invocation_retention=duration("--invocation-retention", args.invocation_retention),
        callback_allow=_networks("--callback-allow", args.callback_allow),
        error_details=_error_details(args.error_details),
        notify_config=_notify_config(args.notify_config, args.secrets_dir),
    )
    logs.configure(config.log_format, config.log_level)
    if config.backend == "local":
        _check_sandbox(config)
    Server(_generated_token(config)).run()
    return EXIT_OK


def _check_sandbox(config: Any) -> None:
    """Probe the sandbox once, before anything starts; previews need one, or trust in all."""
    from ..serve import local_sandbox

    sandbox = local_sandbox(config.sandbox)  # SandboxUnavailable: one line, exit 2
    if config.previews and not sandbox.enabled and config.preview_trust != "all":
        raise UsageError(
            "--previews: pull requests' code would run unconfined on the local backend "
            "(sandbox off); use --sandbox bubblewrap, or --preview-trust all to accept it"
        )
