"""``invocations list|show|redrive``: a running server's asynchronous invocations.

They reach it as the other server verbs do (``--server``, the read token for list and
show, the API token for redrive). ``list`` and ``show`` exit 1 when what they show
failed or died, as ``status`` does for a function that is not Ready; an unknown id is
1, as ``logs`` says of an unknown function. Exit codes: common.EXIT_CODES.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from ..timestamps import epoch
from .client import Client, NotFound, segment
from .common import (
    EXIT_NOT_OK,
    EXIT_OK,
    UsageError,
    add_server_args,
    check_env,
    connect,
    exit_epilog,
)
from .output import PHASE_STYLE, Paint, colour, table, write

__all__ = ["add_parsers"]

STATUSES = ("queued", "running", "succeeded", "failed", "dead")
BAD = ("failed", "dead")  # what list and show exit 1 for
# an invocation's status in the colour of the phase it is like
STATUS_STYLE = {
    "queued": PHASE_STYLE["Pending"],
    "running": PHASE_STYLE["Running"],
    "succeeded": PHASE_STYLE["Succeeded"],
    "failed": PHASE_STYLE["Failed"],
    "dead": PHASE_STYLE["Failed"],
}
PAGE = 1000  # the most the API lists at once
VERB = "gitops-sless invocations"


def add_parsers(commands: Any) -> None:
    """``invocations`` and its actions: ``list``, ``show``, ``redrive``."""
    text = "a running server's asynchronous invocations: list, show one, redrive"
    parent: argparse.ArgumentParser = commands.add_parser(
        "invocations", help=text, description=text, epilog=exit_epilog("invocations")
    )
    actions = parent.add_subparsers(dest="action", required=True, metavar="list|show|redrive")

    listing = _action(actions, "list", _list, "invocations, oldest first, with their status")
    listing.add_argument("--env", help="only this environment's (default: every environment)")
    listing.add_argument("--function", metavar="NAME", help="only this function's")
    listing.add_argument("--status", choices=STATUSES, help="only in this status")
    listing.add_argument(
        "--limit", type=int, default=100, metavar="N", help="at most N (default: %(default)s)"
    )
    listing.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="(default: table)"
    )
    add_server_args(listing)

    show = _action(
        actions, "show", _show, "one invocation: its request, attempts, response and callback"
    )
    show.add_argument(
        "id", metavar="ID", help="the invocation's id (the 202's Location ends in it)"
    )
    show.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="(default: text)"
    )
    add_server_args(show)

    redrive = _action(
        actions,
        "redrive",
        _redrive,
        "queue a dead or failed invocation again, or (--dead) every dead one of a function",
    )
    redrive.add_argument("id", metavar="ID", nargs="?", help="the invocation to queue again")
    redrive.add_argument(
        "--dead", action="store_true", help="every dead invocation of --function instead of ID"
    )
    redrive.add_argument(
        "--env", help="with --dead: the function's environment (default: the server's)"
    )
    redrive.add_argument("--function", metavar="NAME", help="with --dead: whose dead invocations")
    add_server_args(redrive)


def _action(
    actions: Any, name: str, run: Callable[[argparse.Namespace], int], text: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(
        name, help=text, description=text, epilog=exit_epilog("invocations")
    )
    parser.set_defaults(run=run)
    return parser


# --- list -----------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise UsageError(f"--limit {args.limit}: must be at least 1")
    for flag, value in (("--env", args.env), ("--function", args.function)):
        if value is not None:
            check_env(flag, value)
    which = {"env": args.env, "function": args.function, "status": args.status}
    with connect(args) as client:
        found = _pages(client, {k: v for k, v in which.items() if v}, args.limit)
    bad = any(inv["status"] in BAD for inv in found)
    if args.output == "json":
        print(json.dumps(found, indent=2))
    elif not found:
        print("no invocations" + _filtered(which), file=sys.stderr)
    else:
        print(_table(found, time.time(), colour(sys.stdout)))
    return EXIT_NOT_OK if bad else EXIT_OK


def _pages(client: Client, which: dict[str, str], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` invocations, a page of at most PAGE at a time."""
    found: list[dict[str, Any]] = []
    while len(found) < limit:
        page = min(PAGE, limit - len(found))
        after = {"after": found[-1]["id"]} if found else {}
        more = client.get("/api/v1/invocations", **which, limit=page, **after)
        found += more
        if len(more) < page:
            break
    return found


def _filtered(which: dict[str, str | None]) -> str:
    said = [f"{k} {v}" for k, v in which.items() if v]
    return f" ({', '.join(said)})" if said else ""


def _table(found: list[dict[str, Any]], now: float, paint: Paint) -> str:
    rows = [["ID", "FUNCTION", "STATUS", "ATTEMPTS", "WHEN", "ERROR"]]
    styles = [["dim"] * 6]
    for inv in found:
        rows.append(
            [
                inv["id"],
                f"{inv['env']}/{inv['function']}",
                inv["status"],
                str(inv["attempts"]),
                _when(inv, now),
                _first_line(inv["error"]),
            ]
        )
        styles.append(["", "", STATUS_STYLE.get(inv["status"], ""), "", "", ""])
    if sys.stdout.isatty():  # one line per invocation on a terminal
        width = shutil.get_terminal_size().columns
        room = max(width - sum(max(len(row[i]) for row in rows) + 2 for i in range(5)), 20)
        for row in rows:
            row[5] = row[5] if len(row[5]) <= room else row[5][: room - 1] + "…"
    return table(rows, styles, paint)


def _when(inv: dict[str, Any], now: float) -> str:
    """Since when: its end, or (not ended) its submission."""
    if inv["ended"]:
        return f"ended {_ago(now - (epoch(inv['ended']) or now))}"
    return f"submitted {_ago(now - (epoch(inv['created']) or now))}"


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return "just now"


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


# --- show -----------------------------------------------------------------------------------------


def _show(args: argparse.Namespace) -> int:
    with connect(args) as client:
        found = _get(client, args.id)
    if found is None:
        return EXIT_NOT_OK
    if args.output == "json":
        print(json.dumps(found, indent=2))
    else:
        write(_detail(found, colour(sys.stdout)))
    return EXIT_NOT_OK if found["status"] in BAD else EXIT_OK


def _get(client: Client, invocation_id: str) -> dict[str, Any] | None:
    """The record, or None (said on stderr) when the server has no such invocation."""
    if not invocation_id.strip():
        raise UsageError("the invocation id is empty")
    try:
        return client.get(f"/api/v1/invocations/{segment(invocation_id)}")
    except NotFound as exc:
        print(f"{VERB}: {exc}", file=sys.stderr)
        return None


def _detail(inv: dict[str, Any], paint: Paint) -> str:
    status = paint(inv["status"], STATUS_STYLE.get(inv["status"], ""))
    attempts = f"{inv['attempts']} attempt{'s' if inv['attempts'] != 1 else ''}"
    lines = [f"{paint(inv['id'], 'bold')} {inv['env']}/{inv['function']}: {status} ({attempts})"]
    request = inv["request"]
    lines.append(f"request:   {request['method']} {request['path']}{_size(request)}")
    if inv.get("subject"):
        lines.append(f"subject:   {inv['subject']}")
    lines.append(f"submitted: {inv['created']}")
    if inv["ended"]:
        lines.append(f"ended:     {inv['ended']}")
    elif inv.get("nextAttempt"):
        lines.append(f"next:      {inv['nextAttempt']}")
    if inv["error"]:
        lines.append(f"error:     {paint(inv['error'], 'red')}")
    if inv["attemptLog"]:
        lines.append("attempts:")
        lines += [f"  {_attempt(a, paint)}" for a in inv["attemptLog"]]
    lines += _response(inv["response"])
    lines += _callback(inv["callback"])
    return "\n".join(lines) + "\n"


def _size(body: dict[str, Any]) -> str:
    size = _bytes(body)
    return f", {size} bytes" if size else ""


def _bytes(body: dict[str, Any]) -> int:
    if body["bodyEncoding"] == "base64":
        return len(base64.b64decode(body["body"]))
    return len(body["body"].encode("utf-8"))


def _attempt(attempt: dict[str, Any], paint: Paint) -> str:
    code = str(attempt["statusCode"]) if attempt["statusCode"] is not None else "-"
    line = f"{attempt['number']}  {attempt['started']}  {code:>3}"
    if attempt["error"]:
        line += f"  {paint(_first_line(attempt['error']), 'red')}"
    if not attempt["counted"]:
        line += paint("  (not counted: the server stopped it)", "dim")
    return line


def _response(response: dict[str, Any] | None) -> list[str]:
    if response is None:
        return ["response:  none"]
    cut = ", cut: only the first bytes are kept" if response["truncated"] else ""
    lines = [f"response:  {response['statusCode']}{cut}"]
    if response["bodyEncoding"] == "base64":
        lines.append(f"  <{_bytes(response)} bytes, base64>")
    elif response["body"]:
        lines += [f"  {line}" for line in response["body"].splitlines()]
    return lines


def _callback(callback: dict[str, Any] | None) -> list[str]:
    if callback is None:
        return []
    tries = callback["attempts"]
    state = callback["state"]
    if tries:
        state += f" after {tries} attempt{'s' if tries != 1 else ''}"
    error = f": {callback['error']}" if callback["error"] else ""
    return [f"callback:  {callback['url']} {state}{error}"]


# --- redrive --------------------------------------------------------------------------------------


def _redrive(args: argparse.Namespace) -> int:
    if args.dead:
        if args.id is not None:
            raise UsageError(f"either ID or --dead, not both (got {args.id!r} and --dead)")
        if not args.function:
            raise UsageError("--dead needs --function NAME (and --env, else the server's)")
        check_env("--function", args.function)
        if args.env:
            check_env("--env", args.env)
        with connect(args) as client:
            return _redrive_dead(client, args.env, args.function)
    if args.id is None:
        raise UsageError("which invocation? give its ID, or --dead --function NAME")
    if args.function or args.env:
        raise UsageError("--env and --function go with --dead; ID alone names one invocation")
    with connect(args) as client:
        before = _get(client, args.id)
        if before is None:
            return EXIT_NOT_OK
        if before["status"] not in BAD:
            print(
                f"{VERB}: invocation {before['id']} is {before['status']}: only a dead or "
                "failed one is queued again",
                file=sys.stderr,
            )
            return EXIT_NOT_OK
        after = client.api("POST", f"/api/v1/invocations/{segment(before['id'])}/redrive")
    paint = colour(sys.stdout)
    status = paint(after["status"], STATUS_STYLE.get(after["status"], ""))
    print(f"{after['id']} {after['env']}/{after['function']}: {before['status']} -> {status}")
    return EXIT_OK


def _redrive_dead(client: Client, env: str | None, function: str) -> int:
    env = env or client.get("/api/v1/status")["environment"]
    params = {"env": env, "function": function}
    answer = client.api("POST", "/api/v1/invocations/redrive", params=params)
    n = answer["redriven"]
    print(f"{n} dead invocation{'s' if n != 1 else ''} of {env}/{function} queued again")
    return EXIT_OK
