"""What every verb shares: exit codes, usage errors, the source and server arguments.

Exit codes are the command line's contract with scripts; ``EXIT_CODES`` says, for
each verb, which codes it returns and what each means (``--help`` shows them, and
docs/operating.md lists them in one table that tests/cli/test_cli.py checks against
this one).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from urllib.parse import urlsplit

from ..manifests.model import ENV_NAME
from ..source.snapshot import DirectorySnapshot, Snapshot
from ..web import tokenfile
from .client import Client, server_url

__all__ = [
    "ENV_NAME",
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_LISTEN",
    "EXIT_NOT_OK",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "add_server_args",
    "add_source_args",
    "check_env",
    "connect",
    "described",
    "exit_epilog",
    "positive",
    "target",
]

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
EXIT_NOT_OK, EXIT_ERROR = 1, 2  # the answer is not what was hoped for / could not get one
EXIT_LISTEN = 3  # serve: uvicorn's own code when it cannot bind --listen
EXIT_INTERRUPTED = 130

_USAGE = "bad arguments, or a path or ref that cannot be read"
_SERVER = "a server that cannot be reached or refuses the token"

# verb -> exit code -> what it means (docs/operating.md shows this table, with the
# text in backticks where it names a flag); every verb returns 130 on Ctrl-C as well
EXIT_CODES: dict[str, dict[int, str]] = {
    "validate": {
        0: "every sless.yaml is valid",
        1: "a manifest is invalid (each problem on stderr)",
        2: _USAGE,
    },
    "render": {
        0: "every function rendered",
        1: "a manifest is invalid, or a function waits for a job's result (--job-result): "
        "the others are rendered",
        2: _USAGE,
    },
    "serve": {
        0: "stopped by SIGINT or SIGTERM",
        2: "refused at start: a flag, an environment variable, --repo or the sandbox",
        3: "cannot listen on --listen (the port is in use, or not permitted)",
    },
    "status": {
        0: "every function Ready or Disabled, every last sync converged, no job run failed",
        1: "a function not Ready, a last sync failed or still progressing, or a job run failed",
        2: f"bad arguments, {_SERVER}, or an --env it does not have",
    },
    "diff": {
        0: "no change",
        1: "a change: something to build, run, deploy or remove, or an invalid manifest",
        2: f"bad arguments, a path or ref that cannot be read, {_SERVER}, or an --env it "
        "does not have",
    },
    "logs": {
        0: "printed: the log, the job's runs, or (no http trigger) that it has no replicas, "
        "then its job runs",
        1: "no such function or job, a job of another function, or no build yet",
        2: f"bad arguments, or {_SERVER}",
    },
    "invoke": {
        0: "the function answered 2xx",
        1: "any other answer (the proxy's 404, 502, 503, 504 included)",
        2: f"bad arguments, or {_SERVER}",
    },
    "sync": {
        0: "the pass succeeded (with --wait 0: was requested)",
        1: "the pass failed, or did not finish within --wait",
        2: f"bad arguments, or {_SERVER}",
    },
    "revisions": {
        0: "listed",
        1: "no such function, or none of its revisions is kept",
        2: f"bad arguments, or {_SERVER}",
    },
    "rollback": {
        0: "all of its traffic goes to the revision asked for, and it is pinned there",
        1: "no such function or revision, or a switch refused (nothing earlier to go back "
        "to, the revision serves already, a preview)",
        2: f"bad arguments, or {_SERVER}",
    },
    "unpin": {
        0: "it follows git again (a pass is asked for)",
        1: "no such function, or it is not pinned",
        2: f"bad arguments, or {_SERVER}",
    },
    "invocations": {
        0: "listed or shown, none failed or dead; queued again (with --dead: however many "
        "were dead)",
        1: "one listed or shown failed or is dead, no such invocation, or (redrive) it is "
        "neither dead nor failed",
        2: f"bad arguments, {_SERVER}, or asynchronous invocations off or unavailable",
    },
    "import": {
        0: "everything was converted",
        1: "a refusal (nothing written), or a part left to convert by hand",
        2: "bad arguments, or a folder that cannot be read",
    },
    "completion": {0: "the script was printed", 2: "bad arguments"},
}


class UsageError(Exception):
    """Arguments that cannot work: one line, exit 2."""


def exit_epilog(verb: str) -> str:
    """The verb's exit codes, for the end of its ``--help``."""
    codes = EXIT_CODES[verb] | {EXIT_INTERRUPTED: "interrupted (Ctrl-C)"}
    return "exit codes: " + "; ".join(f"{code} {text}" for code, text in codes.items())


def check_env(flag: str, env: str) -> str:
    if not ENV_NAME.fullmatch(env):
        raise UsageError(f"{flag} {env!r}: must be a DNS-1123 label of at most 40 characters")
    return env


def target(value: str, client: Client) -> tuple[str, str]:
    """``ENV/NAME``, or ``NAME`` in the environment the server follows."""
    env, sep, name = value.rpartition("/")
    if not sep:
        env = client.get("/api/v1/status")["environment"]
    for what, label in (("environment", env), ("function", name)):
        if not ENV_NAME.fullmatch(label):
            raise UsageError(f"{value!r}: {what} {label!r} is not a DNS-1123 label; use ENV/NAME")
    return env, name


def positive(name: str, value: float) -> float:
    if not value > 0:
        raise UsageError(f"{name} {value:g}: must be greater than 0")
    return value


def add_source_args(parser: argparse.ArgumentParser) -> None:
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


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        metavar="URL",
        help="the gitops-sless serve to talk to (default: $SLESS_SERVER or "
        "http://127.0.0.1:8080); reads send $SLESS_READ_TOKEN or the API token, "
        "sync sends the API token",
    )
    parser.add_argument(
        "--token",
        metavar="TOKEN",
        help="the API token (default: $SLESS_API_TOKEN, else the one a local server keeps "
        "in --state-dir's api-token)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="a local server's state folder, whose api-token file is read when no token is "
        "set (default: $SLESS_STATE_DIR, else the nearest .sless-state from the working "
        "directory up, for a server on a loopback address)",
    )


def connect(args: argparse.Namespace, timeout: float = 30.0) -> Client:
    """The server of ``--server``, with the tokens of the flags, the environment, or the
    token file of a local server (:func:`api_token`)."""
    try:
        url = server_url(args.server)
    except ValueError as exc:
        raise UsageError(f"--server {exc}") from None
    read_token = os.environ.get("SLESS_READ_TOKEN") or None
    return Client(url, api_token(args, url, read_token), timeout=timeout, read_token=read_token)


def api_token(args: argparse.Namespace, url: str, read_token: str | None = None) -> str | None:
    """``--token``, else ``$SLESS_API_TOKEN``, else (no read token set either) the token file
    of ``--state-dir`` / ``$SLESS_STATE_DIR``, else of the nearest ``.sless-state`` from the
    working directory up when the server is on this machine (a loopback address): a token
    found that way is never sent to another host."""
    given = getattr(args, "token", None) or os.environ.get("SLESS_API_TOKEN")
    if given or read_token:
        return given or None
    state_dir = getattr(args, "state_dir", None) or os.environ.get("SLESS_STATE_DIR") or None
    if state_dir is None and not _loopback(url):
        return None
    try:
        found = tokenfile.find(state_dir, Path.cwd())
    except tokenfile.TokenFileError as exc:
        raise UsageError(str(exc)) from None
    return found[0] if found else None


def _loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return host == "localhost" or host == "::1" or host.startswith("127.")


def described(snapshot: Snapshot, ref: str | None) -> str:
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
