"""The ``gitops-sless`` command line.

Exit codes: 0 success, 1 invalid manifests, 2 usage errors (bad arguments, a
path or ref that cannot be read).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import gitops_sless

from . import logs, manifest, renderer
from .errors import SlessError
from .source import DirectorySnapshot, Snapshot, open_source

__all__ = ["main"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
_ENV_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")


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
        help="bearer token for POST /api/v1/sync (default: $SLESS_API_TOKEN)",
    )
    serve.add_argument(
        "--webhook-secret",
        default=os.environ.get("SLESS_WEBHOOK_SECRET"),
        help="webhook signing secret (default: $SLESS_WEBHOOK_SECRET)",
    )
    serve.add_argument(
        "--secrets-dir", help="secrets for {secret: NAME, key: KEY}: one file per key, DIR/NAME/KEY"
    )
    serve.add_argument("--max-builds", type=int, default=2, help="concurrent builds (default: 2)")
    serve.add_argument(
        "--build-timeout", type=float, default=600.0, help="seconds per build (default: 600)"
    )
    serve.add_argument(
        "--fetch-timeout", type=float, default=60.0, help="seconds per fetch (default: 60)"
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
        help="seconds between garbage collections of the state folder (default: 3600)",
    )
    serve.add_argument(
        "--trusted-proxies",
        default=os.environ.get("SLESS_TRUSTED_PROXIES", ""),
        metavar="CIDR,...",
        help="CIDRs of the proxies whose forwarding headers are trusted "
        "(default: $SLESS_TRUSTED_PROXIES or none)",
    )
    return parser


def _env_choice(name: str, default: str) -> str:
    # argparse checks the choices of values given on the command line only: a value from
    # the environment is checked by _choice, so a typo there is a usage error as well
    return os.environ.get(name) or default


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise _UsageError(f"{name} {value:g}: must be greater than 0")
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


def _register_secrets(args: argparse.Namespace) -> None:
    """Every secret this process knows of, redacted from log lines before any is written."""
    for value in (
        args.api_token,
        args.webhook_secret,
        os.environ.get("SLESS_GIT_PASSWORD"),
        os.environ.get("SLESS_GIT_SSH_PASSPHRASE"),
    ):
        logs.register_secret(value)
    with contextlib.suppress(ValueError):  # not a URL: the mirror says so later
        logs.register_secret(urlsplit(args.repo).password)  # https://user:password@host/...


def _serve(args: argparse.Namespace) -> int:
    from .serve import ServeConfig, Server  # the server stack loads only for this command

    _register_secrets(args)
    host, sep, port = args.listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise _UsageError(f"--listen {args.listen!r}: expected HOST:PORT")
    if not _ENV_NAME.fullmatch(args.env):
        raise _UsageError(f"--env {args.env!r}: must be a DNS-1123 label of at most 40 characters")
    config = ServeConfig(
        repo=args.repo,
        state_dir=Path(args.state_dir).resolve(),
        branch=args.branch,
        env=args.env,
        host=host.strip("[]") or "127.0.0.1",
        port=int(port),
        poll_interval=_positive("--poll-interval", args.poll_interval),
        api_token=args.api_token or None,
        webhook_secret=args.webhook_secret or None,
        secrets_dir=Path(args.secrets_dir) if args.secrets_dir else None,
        max_builds=int(_positive("--max-builds", args.max_builds)),
        build_timeout=_positive("--build-timeout", args.build_timeout),
        fetch_timeout=_positive("--fetch-timeout", args.fetch_timeout),
        log_format=_choice("SLESS_LOG_FORMAT", args.log_format, logs.FORMATS),
        log_level=_choice("SLESS_LOG_LEVEL", args.log_level, logs.LEVELS),
        keep_builds=_not_negative("--keep-builds", args.keep_builds),
        gc_interval=_positive("--gc-interval", args.gc_interval),
        trusted_proxies=_trusted_proxies(args.trusted_proxies),
    )
    logs.configure(config.log_format, config.log_level)
    Server(config).run()
    return EXIT_OK


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
    config = renderer.RenderConfig(registry=args.registry)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"validate": _validate, "render": _render, "serve": _serve}
    try:
        return handlers[args.command](args)
    except (_UsageError, SlessError) as exc:
        print(f"gitops-sless {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
