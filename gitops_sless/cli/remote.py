"""The verbs that talk to a running server: status, diff, logs, invoke and sync.

They reach it with the API client (``--server URL``, default ``$SLESS_SERVER`` or
http://127.0.0.1:8080; reads send ``$SLESS_READ_TOKEN``, else ``$SLESS_API_TOKEN``,
and ``sync`` sends ``$SLESS_API_TOKEN``). Exit codes: common.EXIT_CODES.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..manifests import load as manifest
from ..source.snapshot import open_source
from .client import Client, NotFound, segment
from .common import (
    EXIT_NOT_OK,
    EXIT_OK,
    UsageError,
    add_server_args,
    add_source_args,
    check_env,
    connect,
    described,
    exit_epilog,
    positive,
    target,
)
from .output import PHASE_STYLE, Paint, colour, progress, short, styled, table, write

__all__ = ["add_parsers"]

POLL_SEC = 0.5  # logs -f: how often to ask for more
GOOD_PHASES = ("Ready", "Idle", "Disabled")
# a last pass that says so: a job waits or failed, a build runs, a function failed
NOT_CONVERGED = ("Failed", "Degraded", "Progressing")
MAX_SYNC_WAIT = 600  # the server waits at most this long


def add_parsers(commands: Any) -> None:
    """``status``, ``diff``, ``logs``, ``invoke`` and ``sync``."""
    status = _verb(
        commands,
        "status",
        _status,
        "environments and functions of a running server, with their "
        "phases, and job runs that did not succeed",
    )
    status.add_argument("--env", help="only this environment (default: every environment)")
    status.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="(default: table)"
    )
    add_server_args(status)

    diff = _verb(
        commands,
        "diff",
        _diff,
        "what a sync of a folder (or --ref commit) would change on the server",
    )
    add_source_args(diff)
    diff.add_argument(
        "--env", help="environment to compare with (default: the one the server follows)"
    )
    diff.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="(default: text)"
    )
    add_server_args(diff)

    logs_cmd = _verb(
        commands,
        "logs",
        _logs,
        "what a function's replicas printed, its build log, or a job's result",
    )
    logs_cmd.add_argument(
        "function", metavar="ENV/NAME", help="the function (NAME alone: the server's environment)"
    )
    what = logs_cmd.add_mutually_exclusive_group()
    what.add_argument("--build", action="store_true", help="the log of its current build")
    what.add_argument("--job", metavar="JOB", help="the runs of one of its jobs: result or error")
    what.add_argument(
        "--request", metavar="ID", help="only what it printed serving one request (X-Request-Id)"
    )
    what.add_argument("--trace", metavar="TRACE_ID", help="only what it printed in one trace")
    logs_cmd.add_argument(
        "-f", "--follow", action="store_true", help="keep printing what is added (Ctrl-C stops)"
    )
    add_server_args(logs_cmd)

    invoke = _verb(commands, "invoke", _invoke, "call a function through the server's /fn/ proxy")
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
    add_server_args(invoke)

    sync = _verb(commands, "sync", _sync, "ask the server for a pass now and wait for its result")
    sync.add_argument(
        "--wait",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help=f"how long to wait for the pass, at most {MAX_SYNC_WAIT} (0: do not wait; "
        "default: %(default)g)",
    )
    add_server_args(sync)


def _verb(
    commands: Any, name: str, run: Callable[[argparse.Namespace], int], text: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(name, help=text, epilog=exit_epilog(name))
    parser.set_defaults(run=run)
    return parser


def _revision(fn: dict[str, Any]) -> str:
    """The revision serving and its commit: ``r3 9f2c41d0a7e3``."""
    commit = short(fn["revision"])
    number = fn.get("servingRevision")
    return f"{number} {commit}" if number else commit


def _message(fn: dict[str, Any]) -> str:
    message = (fn.get("message") or "").strip().splitlines()
    text = message[0] if message else ""
    if fn.get("pinned"):  # it differs from git on purpose: say so first
        pinned = f"pinned at {fn['pinned']} by a rollback (gitops-sless unpin to follow git)"
        text = f"{pinned}; {text}" if text else pinned
    scaled = fn.get("scaling")
    if scaled:  # autoscaled: ready out of desired, within min..max, and the load
        desired = "?" if scaled["desired"] is None else scaled["desired"]
        load = f"{scaled['ready']}/{desired} replicas ({scaled['min']}..{scaled['max']}), "
        load += f"{scaled['concurrency']:g} in flight"
        if scaled.get("lastColdStartMs") is not None:
            load += f", last cold start {scaled['lastColdStartMs']:g} ms"
        text = f"{load}; {text}" if text else load
    if fn.get("restarts"):
        text = (text + "; " if text else "") + f"{fn['restarts']} restarts"
        if fn.get("lastExit") and fn["lastExit"] not in text:
            text += f", last: {fn['lastExit']}"
    return text


def _known_environments(client: Client, wanted: str | None) -> dict[str, dict[str, Any]]:
    """The server's environments by name; a ``wanted`` one it does not have is exit 2."""
    environments = {e["name"]: e for e in client.get("/api/v1/environments")}
    if wanted and wanted not in environments:
        known = ", ".join(sorted(environments)) or "none yet"
        raise UsageError(f"the server has no environment {wanted!r} (it has: {known})")
    return environments


def _open_runs(runs: list[dict[str, Any]], functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest run of each job of a function still there, unless it succeeded."""
    names = {fn["name"] for fn in functions}
    newest: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run["function"] in names and run["runId"] >= newest.get(run["name"], run)["runId"]:
            newest[run["name"]] = run
    return [run for _, run in sorted(newest.items()) if run["phase"] != "Succeeded"]


def _environment(client: Client, name: str, row: dict[str, Any] | None) -> dict[str, Any]:
    where = f"/api/v1/environments/{segment(name)}"
    functions = client.get(f"{where}/functions")
    return {
        "name": name,
        "lastSync": (row or {}).get("lastSync"),
        "functions": functions,
        "jobs": _open_runs(client.get(f"{where}/jobs"), functions),
    }


def _all_good(listing: list[dict[str, Any]]) -> bool:
    """Every function serves (or is off), every last pass converged, no job run failed."""
    return (
        all(fn["phase"] in GOOD_PHASES for env in listing for fn in env["functions"])
        and not any(
            env["lastSync"] and env["lastSync"]["result"] in NOT_CONVERGED for env in listing
        )
        and not any(run["phase"] == "Failed" for env in listing for run in env["jobs"])
    )


def _status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        status = client.get("/api/v1/status")
        environments = _known_environments(client, args.env)
        names = [args.env] if args.env else sorted(environments) or [status["environment"]]
        listing = [_environment(client, name, environments.get(name)) for name in names]
    ok = _all_good(listing)
    if args.output == "json":
        answer = {"server": client.server, "ok": ok, "status": status, "environments": listing}
        print(json.dumps(answer, indent=2))
        return EXIT_OK if ok else EXIT_NOT_OK
    paint = colour(sys.stdout)
    print(
        f"{client.server}: {status['repository']} ({status['branch']}), "
        f"last good revision {short(status['lastGoodRevision'])}"
    )
    for env in listing:
        last = env["lastSync"]
        if last:
            error = f": {last['error'].splitlines()[0]}" if last["error"] else ""
            print(
                f"\n{paint(env['name'], 'bold')}: last sync "
                f"{styled(last['result'], paint)} at "
                f"{short(last['revision'])} ({last['trigger']}, "
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
                    _revision(fn),
                    fn["buildTag"] or "-",
                    _message(fn),
                ]
            )
            styles.append(["", PHASE_STYLE.get(fn["phase"], ""), "", "", ""])
        if sys.stdout.isatty():  # one line per function on a terminal
            width = shutil.get_terminal_size().columns
            prefix = sum(max(len(row[i]) for row in rows) + 2 for i in range(4))
            for row in rows:
                room = max(width - prefix, 20)
                row[4] = row[4] if len(row[4]) <= room else row[4][: room - 1] + "…"
        print(table(rows, styles, paint))
        _print_open_runs(env["jobs"], paint)
    return EXIT_OK if ok else EXIT_NOT_OK


def _print_open_runs(runs: list[dict[str, Any]], paint: Paint) -> None:
    """Job runs that did not succeed, under the functions: a failed one is no secret."""
    if not runs:
        return
    rows = [["JOB", "RUN", "FUNCTION", "PHASE", "MESSAGE"]]
    styles = [["dim"] * 5]
    for run in runs:
        error = (run["error"] or "").strip().splitlines()
        attempts = f"attempt {run['attempts']}" if run["attempts"] else "not started"
        rows.append(
            [
                run["name"],
                str(run["runId"]),
                run["function"],
                run["phase"],
                error[0] if error else attempts,
            ]
        )
        styles.append(["", "", "", PHASE_STYLE.get(run["phase"], ""), ""])
    print()
    print(table(rows, styles, paint))


# --- diff -----------------------------------------------------------------------------------------


def _diff(args: argparse.Namespace) -> int:
    from ..web.diffs import DiffRequest  # pydantic: loaded for this command only

    snapshot = open_source(args.path, args.ref)
    state = manifest.load(snapshot)
    body = DiffRequest.from_state(state).model_dump(mode="json", by_alias=True)
    with connect(args, timeout=120.0) as client:
        env = args.env or client.get("/api/v1/status")["environment"]
        check_env("--env", env)
        if args.env:  # else every function would show as added to an environment not there
            _known_environments(client, env)
        answer = client.api("POST", f"/api/v1/environments/{segment(env)}/diff", json=body)
    if args.output == "json":
        print(json.dumps(answer, indent=2))
    else:
        _print_diff(answer, f"{described(snapshot, args.ref)}; {env} on {client.server}")
    return EXIT_NOT_OK if answer["hasChanges"] else EXIT_OK


def _print_diff(answer: dict[str, Any], what: str) -> None:
    paint = colour(sys.stdout)
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
        out += [f"    {field['field']}: {_field_change(field)}" for field in fn["fields"]]
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


def _chunks(client: Client, path: str, follow: bool, **only: str) -> Iterator[dict[str, Any]]:
    """Pages of a log from its start; with ``follow``, new ones as they are written;
    ``only``: the API's filters (``request``, ``trace``)."""
    offset = 0
    while True:
        chunk = client.get(path, offset=offset, **only)
        yield chunk
        progressed = chunk["reset"] or chunk["nextOffset"] != offset
        offset = chunk["nextOffset"]
        if progressed and offset < chunk["size"]:
            continue  # more is there already
        if not follow or chunk["finished"]:
            return
        time.sleep(POLL_SEC)


def _print_log(client: Client, path: str, follow: bool, **only: str) -> int:
    for chunk in _chunks(client, path, follow, **only):
        if chunk["reset"]:
            print("--- the log was cut; reading from its start ---", file=sys.stderr, flush=True)
        if chunk["text"]:
            write(chunk["text"])
    return EXIT_OK


def _run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    return (run["runId"], run["phase"], run["attempts"], run["finished"])


def _print_run(run: dict[str, Any], paint: Paint) -> None:
    when = " -> ".join(t for t in (run["started"], run["finished"]) if t) or "not started"
    attempts = f"attempt {run['attempts']}, " if run["attempts"] else ""
    phase = styled(run["phase"], paint)
    lines = [f"{run['name']} run {run['runId']}: {phase} ({attempts}{when})"]
    if run["result"] is not None:
        try:
            lines.append(json.dumps(json.loads(run["result"]), indent=2))
        except ValueError:
            lines.append(run["result"])
    if run["error"]:
        lines.append(run["error"])
    write("\n".join(lines) + "\n")


def _print_job(client: Client, env: str, name: str, job: str, follow: bool) -> int:
    paint = colour(sys.stdout)
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
    with connect(args) as client:
        env, name = target(args.function, client)
        try:
            if args.job:
                return _print_job(client, env, name, args.job, args.follow)
            where = f"/api/v1/environments/{segment(env)}/functions/{segment(name)}"
            detail = client.get(where)
            if not args.build and detail["url"] is None:
                return _print_no_replicas(env, detail)
            if not args.build:
                only = {k: getattr(args, k) for k in ("request", "trace") if getattr(args, k)}
                if "trace" in only:
                    only["trace"] = only["trace"].lower()  # as traceparent writes it
                return _print_log(client, f"{where}/logs", args.follow, **only)
            # the build of what the repository asks for (a failed one too), else what runs
            tag = (detail.get("build") or {}).get("tag") or detail["buildTag"]
            if not tag:
                print(f"gitops-sless logs: {env}/{name} has no build yet", file=sys.stderr)
                return EXIT_NOT_OK
            return _print_log(client, f"/api/v1/builds/{segment(tag)}/log", args.follow)
        except NotFound as exc:
            print(f"gitops-sless logs: {exc}", file=sys.stderr)
            return EXIT_NOT_OK


def _print_no_replicas(env: str, detail: dict[str, Any]) -> int:
    """A function with no http trigger runs no replica, so has no log: say so, show its
    job runs instead (what it printed as a job is their result or error)."""
    runs = sorted(detail["jobs"], key=lambda run: (run["name"], run["runId"]))
    then = (
        "its job runs follow (--job JOB for one of them, --build for its build log)"
        if runs
        else "it has no job runs either (--build shows its build log)"
    )
    print(
        f"gitops-sless logs: {env}/{detail['name']} has no replicas (no http trigger), "
        f"so no replica log; {then}",
        file=sys.stderr,
    )
    paint = colour(sys.stdout)
    for run in runs:
        _print_run(run, paint)
    return EXIT_OK


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
            raise UsageError(f"--data {data}: {exc.strerror or exc}") from None
    return data.encode()


def _headers(pairs: Sequence[str], body: bytes | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name.strip()):
            raise UsageError(f"--header {pair!r}: expected 'NAME: VALUE'")
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
        raise UsageError(f"-X {args.method!r}: not an HTTP method")
    sub = args.path if args.path.startswith("/") else "/" + args.path
    with connect(args) as client:
        env, name = target(args.function, client)
        started = time.monotonic()
        response = client.invoke(
            method,
            f"/fn/{segment(env)}/{segment(name)}{sub}",
            content=body,
            headers=headers,
            timeout=positive("--timeout", args.timeout),
        )
    took = (time.monotonic() - started) * 1000
    content = response.content
    sys.stdout.buffer.write(content)
    if content and not content.endswith(b"\n") and _textual(response.headers):
        # a shell prompt after the answer, not on its line; bytes stay exactly as sent
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


def _sync(args: argparse.Namespace) -> int:
    wait = args.wait
    if not 0 <= wait <= MAX_SYNC_WAIT:
        raise UsageError(f"--wait {wait:g}: must be 0 to {MAX_SYNC_WAIT}")
    with connect(args) as client, progress("syncing"):
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
    paint = colour(sys.stdout)
    error = f": {last['error']}" if last["error"] else ""
    print(f"{styled(last['result'], paint)} at {short(last['revision'])}{error}")
    return EXIT_OK if last["result"] == "Succeeded" else EXIT_NOT_OK


def _textual(headers: Mapping[str, str]) -> bool:
    """Text or JSON (what a person reads), as opposed to bytes kept exact (an image)."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    return kind.startswith("text/") or kind == "application/json" or kind.endswith("+json")


def _field_change(field: Mapping[str, Any]) -> str:
    """One changed field as a person reads it: ``old -> new``, ``added secret db key dsn``,
    or what changed when the values are not shown (two literals)."""
    old, new, detail = field["old"], field["new"], field["detail"]
    if detail in ("added", "removed"):
        return f"{detail} {new if detail == 'added' else old}"
    if old is not None and new is not None and old != new:
        return f"{old} -> {new}" + (f" ({detail})" if detail else "")
    if detail:
        return detail
    return new or old or ""
