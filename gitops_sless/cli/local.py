"""The verbs that work on a repository on disk, with no server: validate, render, import."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..kube import renderer
from ..manifests import load as manifest
from ..manifests import model
from ..source.snapshot import open_source
from .common import (
    EXIT_INVALID,
    EXIT_NOT_OK,
    EXIT_OK,
    UsageError,
    add_source_args,
    check_env,
    described,
    exit_epilog,
)

__all__ = ["add_import_parser", "add_parsers"]


def add_parsers(commands: Any) -> None:
    """``validate`` and ``render``."""
    validate = commands.add_parser(
        "validate", help="check every sless.yaml of a repository", epilog=exit_epilog("validate")
    )
    add_source_args(validate)
    validate.set_defaults(run=_validate)

    render = commands.add_parser(
        "render",
        help="print the Kubernetes objects of one environment as YAML",
        epilog=exit_epilog("render"),
    )
    add_source_args(render)
    render.set_defaults(run=_render)
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


def _report_invalid(state: model.DesiredState) -> None:
    for problem in state.problems:
        print(problem, file=sys.stderr)


def _validate(args: argparse.Namespace) -> int:
    snapshot = open_source(args.path, args.ref)
    state = manifest.load(snapshot)
    _report_invalid(state)
    manifests = {fn.manifest for fn in state.functions.values()}
    print(
        f"{len(state.functions)} functions in {len(manifests)} valid manifests, "
        f"{len(state.invalid)} invalid ({described(snapshot, args.ref)})"
    )
    return EXIT_INVALID if state.invalid else EXIT_OK


def _job_results(pairs: Sequence[str]) -> dict[str, str]:
    results = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise UsageError(f"--job-result {pair!r}: expected JOB=JSON")
        try:
            json.loads(value)
        except ValueError as exc:
            raise UsageError(f"--job-result {name}: {value!r} is not JSON") from exc
        results[name] = value
    return results


def _render(args: argparse.Namespace) -> int:
    check_env("--env", args.env)
    state = manifest.load(open_source(args.path, args.ref))
    _report_invalid(state)
    try:
        gateway = renderer.parse_gateway(args.gateway) if args.gateway else None
    except ValueError as exc:
        raise UsageError(f"--gateway: {exc}") from exc
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
    # 0 says every function rendered: one left out for a job's result is not
    return EXIT_INVALID if state.invalid or rendered.waiting else EXIT_OK


def add_import_parser(commands: Any) -> None:
    """``import terraform``."""
    sources = commands.add_parser(
        "import",
        help="turn another tool's configuration into a repository",
        epilog=exit_epilog("import"),
    )
    sources.set_defaults(run=_import)
    kinds = sources.add_subparsers(dest="source", required=True)
    terraform = kinds.add_parser(
        "terraform",
        help="the sless Terraform provider's .tf files and code as a repository",
        epilog=exit_epilog("import"),
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
    from ..tfimport import Refusal, import_terraform  # loads the HCL parser only when asked

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
