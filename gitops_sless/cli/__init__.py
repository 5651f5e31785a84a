"""The ``gitops-sless`` command line.

``validate``, ``render`` and ``import`` work on files on disk (local.py); ``serve``
follows a repository (serve.py); ``status``, ``diff``, ``logs``, ``invoke`` and
``sync`` talk to a running server (remote.py), and so does ``invocations
list|show|redrive``, for its asynchronous invocations (invocations.py), and
``revisions``, ``rollback`` and ``unpin``, for a function's revisions (revisions.py);
``completion`` prints shell scripts (completion.py). What they share: common.py
(exit codes, usage errors, arguments) and output.py (colours, tables).

Exit codes, in short (common.EXIT_CODES has each verb's, docs/operating.md the
table): 0 success; 1 the answer is not what was hoped for (invalid manifests, a
function not Ready, a difference, a non-2xx answer, a failed sync, no such
function, an invocation that failed or died); 2 an error: bad arguments, a path
or ref that cannot be read, a server that cannot be reached or refuses the token,
an environment it does not have; 3 serve cannot listen; 130 interrupted.

May import: every layer below it (it is the top, under ``__main__``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

import gitops_sless

from ..errors import SlessError
from . import completion, invocations, local, remote, revisions, serve
from .client import ClientError
from .common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
from .serve import TRUST_LEVELS as _TRUST_LEVELS  # noqa: F401 - tests hold it to trust's

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The whole command line: every verb, in the order ``--help`` lists them."""
    root = argparse.ArgumentParser(
        prog="gitops-sless", description="Serverless functions on Kubernetes, deployed by git push."
    )
    root.add_argument(
        "--version", action="version", version=f"gitops-sless {gitops_sless.__version__}"
    )
    commands = root.add_subparsers(dest="command", required=True)
    local.add_parsers(commands)
    serve.add_parser(commands)
    remote.add_parsers(commands)
    invocations.add_parsers(commands)
    revisions.add_parsers(commands)
    local.add_import_parser(commands)
    completion.add_parser(commands, root)
    return root


_parser = parser  # the name tests and older callers use


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["__complete"]:
        return completion.complete(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (UsageError, SlessError) as exc:
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
