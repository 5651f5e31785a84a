"""``revisions``, ``rollback`` and ``unpin``: a running server's revisions of a function.

They reach it as the other server verbs do (``--server``; the read token for
``revisions``, the API token for ``rollback`` and ``unpin``). A revision or function
the server does not keep, or a switch it refuses (nothing earlier to go back to, not
pinned), is exit 1, as ``logs`` says of an unknown function. Exit codes:
common.EXIT_CODES.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from ..timestamps import epoch
from .client import Client, ClientError, NotFound, segment
from .common import (
    EXIT_NOT_OK,
    EXIT_OK,
    UsageError,
    add_server_args,
    connect,
    exit_epilog,
    target,
)
from .output import colour, short, table, write

__all__ = ["add_parsers"]

REF_HELP = "rN or a revision id (default: the newest kept before the one serving)"


def add_parsers(commands: Any) -> None:
    """``revisions``, ``rollback`` and ``unpin``."""
    listing = _verb(
        commands,
        "revisions",
        _revisions,
        "a function's kept revisions: which serves, which is pinned, each one's own URL",
    )
    _function_arg(listing)
    listing.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="(default: table)"
    )
    add_server_args(listing)

    rollback = _verb(
        commands,
        "rollback",
        _rollback,
        "send all of a function's traffic to an earlier kept revision at once, without a "
        "build; it stays pinned there until a commit changes it or an unpin",
    )
    _function_arg(rollback)
    rollback.add_argument("--to", metavar="REVISION", help=REF_HELP)
    add_server_args(rollback)

    unpin = _verb(
        commands,
        "unpin",
        _unpin,
        "let a rolled-back function follow git again (the next pass deploys what git says)",
    )
    _function_arg(unpin)
    add_server_args(unpin)


def _verb(
    commands: Any, name: str, run: Callable[[argparse.Namespace], int], text: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=text, description=text, epilog=exit_epilog(name)
    )
    parser.set_defaults(run=run)
    return parser


def _function_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "function", metavar="ENV/NAME", help="the function (NAME alone: the server's environment)"
    )


def _where(client: Client, value: str) -> str:
    env, name = target(value, client)
    return f"/api/v1/environments/{segment(env)}/functions/{segment(name)}"


def _revisions(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            found = client.get(_where(client, args.function) + "/revisions")
        except NotFound as exc:
            print(f"gitops-sless revisions: {exc}", file=sys.stderr)
            return EXIT_NOT_OK
    if args.output == "json":
        write(json.dumps(found, indent=2) + "\n")
        return EXIT_OK
    _show(found)
    return EXIT_OK


def _show(found: dict[str, Any]) -> None:
    paint = colour(sys.stdout)
    pin = found.get("pinned")
    head = f"{found['env']}/{found['function']}: {found['serving'] or 'nothing'} serves"
    if pin:
        head += f", pinned at {pin['revision']} by {pin['by']} (a commit that changes it, or "
        head += "`gitops-sless unpin`, lets it follow git again)"
    rows = [["REVISION", "ID", "TRAFFIC", "STATE", "REPLICAS", "COMMIT", "CREATED", "URL"]]
    styles = [["2"] * len(rows[0])]
    for r in found["revisions"]:
        rows.append(
            [
                r["revision"],
                r["id"],
                f"{r['traffic']}%",
                r["state"],
                str(r["replicas"]),
                short(r["commit"]),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch(r["created"]))),
                r["url"],
            ]
        )
        styles.append(["1" if r["state"] == "serving" else ""] + [""] * (len(rows[0]) - 1))
    write(head + "\n" + table(rows, styles, paint) + "\n")


def _switch(args: argparse.Namespace, action: str, body: dict[str, Any] | None) -> int:
    with connect(args) as client:
        path = _where(client, args.function) + f"/{action}"
        try:
            found = client.api("POST", path, json=body, timeout=120)
        except NotFound as exc:
            print(f"gitops-sless {action}: {exc}", file=sys.stderr)
            return EXIT_NOT_OK
        except ClientError as exc:
            if "answered 409" not in str(exc):
                raise
            print(f"gitops-sless {action}: {str(exc).split(': ', 1)[-1]}", file=sys.stderr)
            return EXIT_NOT_OK
    _show(found)
    return EXIT_OK


def _rollback(args: argparse.Namespace) -> int:
    if args.to is not None and not args.to.strip():
        raise UsageError("--to: name a revision (rN or its id)")
    return _switch(args, "rollback", {"to": args.to} if args.to else None)


def _unpin(args: argparse.Namespace) -> int:
    return _switch(args, "unpin", None)
