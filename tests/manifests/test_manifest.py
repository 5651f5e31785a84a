"""Loading sless.yaml manifests: every bad input gets one precise line, good input loads."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gitops_sless.manifests import load as manifest
from gitops_sless.manifests import model
from gitops_sless.manifests.model import CronTrigger, DesiredState, Job, JobRef, SecretRef
from gitops_sless.source.snapshot import DirectorySnapshot, GitSnapshot, open_snapshot

from ..gitserver import git

HANDLER = "def main(event):\n    return event\n"
NODE_HANDLER = "exports.main = async (event) => event;\n"
CRUD_HANDLER = "def crud(event):\n    return event\n"


def manifest_text(
    *extra: str, name: str = "fn", runtime: str = "python3.11", entrypoint: str = "handler.main"
) -> str:
    """A one-function sless.yaml. Lines 1-4 are fixed; the ``extra`` lines start at line 5."""
    lines = [
        "functions:",
        f"  - name: {name}",
        f"    runtime: {runtime}",
        f"    entrypoint: {entrypoint}",
        *extra,
    ]
    return "\n".join(lines) + "\n"


def repo(text: str | bytes) -> dict[str, str | bytes]:
    """``fn/sless.yaml`` with ``text`` and a Python handler ``fn/handler.py``."""
    return {"fn/sless.yaml": text, "fn/handler.py": HANDLER}


def one(*extra: str, **kwargs: str) -> dict[str, str | bytes]:
    return repo(manifest_text(*extra, **kwargs))


def cron(schedule: str) -> dict[str, str | bytes]:
    """A function with one cron trigger; the schedule is on line 7."""
    return one("    triggers:", "      - type: cron", f"        schedule: '{schedule}'")


def make_links(root: Path, links: Mapping[str, str]) -> None:
    for rel, target in links.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, path)


def git_commit_all(root: Path) -> None:
    """Make ``root`` a git repository whose HEAD commit holds every file in it."""
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "test"]):
        git(*args, cwd=root)


def git_tree_of(root: Path, folder: str) -> str:
    return git("rev-parse", f"HEAD:{folder}", cwd=root)


def git_tree_without_manifest(root: Path, folder: str) -> str:
    """What git names the tree of ``folder`` with its sless.yaml taken out."""
    listing = git("ls-tree", f"HEAD:{folder}", cwd=root).splitlines()
    kept = "".join(f"{line}\n" for line in listing if not line.endswith("\tsless.yaml"))
    made = subprocess.run(
        ["git", "mktree"], cwd=root, input=kept, capture_output=True, text=True, check=True
    )
    return made.stdout.strip()


def problem_lines(state: DesiredState) -> list[str]:
    return [str(problem) for problem in state.problems]


def bad(
    id: str, files: dict[str, str | bytes], *expected: str, links: Mapping[str, str] | None = None
) -> Any:
    return pytest.param(files, dict(links or {}), list(expected), id=id)


M = "fn/sless.yaml"
DNS_HINT = (
    "must be a DNS-1123 label: lowercase letters, digits and '-', "
    "starting with a letter and ending with a letter or digit"
)
ENV_NAME_HINT = (
    "must match [A-Za-z_][A-Za-z0-9_]* and not start with SLESS_ (reserved for the runtime)"
)
RUNTIMES = '"python3.11", "nodejs20"'
CRON_FIELDS = "a schedule has five: minute hour day-of-month month day-of-week"
KNOWN_FUNCTION_FIELDS = (
    "name, runtime, entrypoint, memoryMB, maxProcesses, timeoutSec, replicas, scale, "
    "concurrency, rateLimit, maxBodyBytes, async, rollout, stream, enabled, env, triggers, jobs, "
    "preview"
)

# Ten levels of ten aliases each: 10**10 values once expanded.
ALIAS_BOMB = (
    "x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]\n" for i in range(1, 10))
    + manifest_text()
)

BAD_CASES = [
    # --- wrong types ----------------------------------------------------------------
    bad(
        "name-number",
        one(name="5"),
        f"{M}:2: functions[0].name: 5 is a number; expected a string (quote it)",
    ),
    bad(
        "name-list",
        one(name="[fn]"),
        f'{M}:2: functions[0].name: ["fn"] is a list; expected a string',
    ),
    bad(
        "name-null",
        one(name="~"),
        f"{M}:2: functions[0].name: has no value; expected a string",
    ),
    bad(
        "runtime-number",
        one(runtime="20"),
        f"{M}:3: functions[0].runtime: 20 is not one of {RUNTIMES}",
    ),
    bad(
        "entrypoint-number",
        one(entrypoint="5"),
        f"{M}:4: functions[0].entrypoint: 5 is a number; expected a string (quote it)",
    ),
    bad(
        "memory-string",
        one("    memoryMB: lots"),
        f'{M}:5: functions[0].memoryMB: "lots" is a string; expected a whole number',
    ),
    bad(
        "memory-quoted-number",
        one('    memoryMB: "256"'),
        f'{M}:5: functions[0].memoryMB: "256" is a string; expected a whole number',
    ),
    bad(
        "memory-fraction",
        one("    memoryMB: 128.5"),
        f"{M}:5: functions[0].memoryMB: 128.5 is a number; expected a whole number",
    ),
    bad(
        "timeout-boolean",
        one("    timeoutSec: true"),
        f"{M}:5: functions[0].timeoutSec: true is a boolean; expected a whole number",
    ),
    bad(
        "replicas-string",
        one("    replicas: two"),
        f'{M}:5: functions[0].replicas: "two" is a string; expected a whole number',
    ),
    bad(
        "enabled-string",
        one("    enabled: yes please"),
        f'{M}:5: functions[0].enabled: "yes please" is a string; expected true or false',
    ),
    bad(
        "enabled-number",
        one("    enabled: 1"),
        f"{M}:5: functions[0].enabled: 1 is a number; expected true or false",
    ),
    bad(
        "env-list",
        one("    env: [A, B]"),
        f'{M}:5: functions[0].env: ["A", "B"] is a list; expected a mapping',
    ),
    bad(
        "env-string",
        one("    env: A=1"),
        f'{M}:5: functions[0].env: "A=1" is a string; expected a mapping',
    ),
    bad(
        "triggers-mapping",
        one("    triggers: {type: http}"),
        f'{M}:5: functions[0].triggers: {{"type": "http"}} is a mapping; expected a list',
    ),
    bad(
        "trigger-string",
        one("    triggers:", "      - http"),
        f'{M}:6: functions[0].triggers[0]: "http" is a string; expected a mapping',
    ),
    bad(
        "jobs-string",
        one("    jobs: setup"),
        f'{M}:5: functions[0].jobs: "setup" is a string; expected a list',
    ),
    bad(
        "runid-string",
        one("    jobs:", "      - name: setup", "        runId: one"),
        f'{M}:7: functions[0].jobs[0].runId: "one" is a string; expected a whole number',
    ),
    bad(
        "job-event-string",
        one("    jobs:", "      - name: setup", "        runId: 1", "        event: hello"),
        f'{M}:8: functions[0].jobs[0].event: "hello" is a string; expected a mapping',
    ),
    bad(
        "cron-event-list",
        one(
            "    triggers:",
            "      - type: cron",
            "        schedule: '0 2 * * *'",
            "        event: [daily]",
        ),
        f'{M}:8: functions[0].triggers[0].event: ["daily"] is a list; expected a mapping',
    ),
    bad(
        "cron-schedule-number",
        one("    triggers:", "      - type: cron", "        schedule: 5"),
        f"{M}:7: functions[0].triggers[0].schedule: 5 is a number; expected a string (quote it)",
    ),
    bad(
        "preview-list",
        one("    preview: [1]"),
        f"{M}:5: functions[0].preview: [1] is a list; expected a mapping",
    ),
    bad(
        "preview-unknown-field",
        one("    preview:", "      memoryMB: 256"),
        f"{M}:6: functions[0].preview.memoryMB: unknown field; known fields: env, scale",
    ),
    bad(
        "functions-mapping",
        repo("functions: {name: fn}\n"),
        f'{M}:1: functions: {{"name": "fn"}} is a mapping; expected a list',
    ),
    bad(
        "functions-null",
        repo("functions:\n"),
        f"{M}:1: functions: has no value; expected a list",
    ),
    bad(
        "function-item-string",
        repo("functions:\n  - fn\n"),
        f'{M}:2: functions[0]: "fn" is a string; expected a mapping',
    ),
    # --- out of range -------------------------------------------------------------------
    bad(
        "negative-memory",
        one("    memoryMB: -10"),
        f"{M}:5: functions[0].memoryMB: -10 is less than the minimum of 64",
    ),
    bad(
        "memory-below-minimum",
        one("    memoryMB: 63"),
        f"{M}:5: functions[0].memoryMB: 63 is less than the minimum of 64",
    ),
    bad(
        "huge-memory",
        one("    memoryMB: 100000"),
        f"{M}:5: functions[0].memoryMB: 100000 is greater than the maximum of 4096",
    ),
    bad(
        "timeout-zero",
        one("    timeoutSec: 0"),
        f"{M}:5: functions[0].timeoutSec: 0 is less than the minimum of 1",
    ),
    bad(
        "timeout-901",
        one("    timeoutSec: 901"),
        f"{M}:5: functions[0].timeoutSec: 901 is greater than the maximum of 900",
    ),
    bad(
        "replicas-21",
        one("    replicas: 21"),
        f"{M}:5: functions[0].replicas: 21 is greater than the maximum of 20",
    ),
    bad(
        "replicas-negative",
        one("    replicas: -1"),
        f"{M}:5: functions[0].replicas: -1 is less than the minimum of 0",
    ),
    bad(
        "runid-negative",
        one("    jobs:", "      - name: setup", "        runId: -1"),
        f"{M}:7: functions[0].jobs[0].runId: -1 is less than the minimum of 0",
    ),
    bad(
        "runid-too-big",
        one("    jobs:", "      - name: setup", "        runId: 2147483648"),
        f"{M}:7: functions[0].jobs[0].runId: 2147483648 is greater than the maximum of 2147483647",
    ),
    bad(
        "not-a-finite-number",
        one("    memoryMB: .inf"),
        f"{M}:5: functions[0].memoryMB: .inf is not a finite number",
    ),
    # --- missing ------------------------------------------------------------------------
    bad(
        "missing-name",
        repo("functions:\n  - runtime: python3.11\n    entrypoint: handler.main\n"),
        f"{M}:2: functions[0].name: is required",
    ),
    bad(
        "missing-runtime",
        repo("functions:\n  - name: fn\n    entrypoint: handler.main\n"),
        f"{M}:2: functions[0].runtime: is required",
    ),
    bad(
        "missing-entrypoint",
        repo("functions:\n  - name: fn\n    runtime: python3.11\n"),
        f"{M}:2: functions[0].entrypoint: is required",
    ),
    bad(
        "missing-functions",
        repo("function:\n  - name: fn\n"),
        f"{M}:1: function: unknown field; did you mean 'functions'?",
        f"{M}:1: functions: is required",
    ),
    bad(
        "functions-empty",
        repo("functions: []\n"),
        f"{M}:1: functions: must not be empty",
    ),
    bad(
        "cron-without-schedule",
        one("    triggers:", "      - type: cron"),
        f"{M}:6: functions[0].triggers[0].schedule: is required",
    ),
    bad(
        "trigger-without-type",
        one("    triggers:", "      - schedule: '0 2 * * *'"),
        f"{M}:6: functions[0].triggers[0].type: is required",
    ),
    bad(
        "job-without-name",
        one("    jobs:", "      - runId: 1"),
        f"{M}:6: functions[0].jobs[0].name: is required",
    ),
    bad(
        "job-without-runid",
        one("    jobs:", "      - name: setup"),
        f"{M}:6: functions[0].jobs[0].runId: is required",
    ),
    bad(
        "secret-without-key",
        one("    env:", "      PG_DSN: {secret: notes-db}"),
        f"{M}:6: functions[0].env.PG_DSN.key: is required",
    ),
    bad(
        "empty-secret-ref",
        one("    env:", "      PG_DSN: {}"),
        f"{M}:6: functions[0].env.PG_DSN.key: is required",
        f"{M}:6: functions[0].env.PG_DSN.secret: is required",
    ),
    # --- entrypoint ---------------------------------------------------------------------
    bad(
        "empty-entrypoint",
        one(entrypoint='""'),
        f"{M}:4: functions[0].entrypoint: must not be empty",
    ),
    bad(
        "entrypoint-without-function",
        one(entrypoint="handler"),
        f'{M}:4: functions[0].entrypoint: "handler" must be <file path without extension>.'
        "<function name>, e.g. handler.main",
    ),
    bad(
        "entrypoint-with-space",
        one(entrypoint="'my handler.main'"),
        f'{M}:4: functions[0].entrypoint: "my handler.main" must be <file path without '
        "extension>.<function name>, e.g. handler.main",
    ),
    bad(
        "entrypoint-dotdot",
        one(entrypoint="../shared/handler.main"),
        f"{M}:4: functions[0].entrypoint: '../shared/handler.main': '..', '.' and empty path "
        "segments are not allowed",
    ),
    bad(
        "entrypoint-dot-segment",
        one(entrypoint="./handler.main"),
        f"{M}:4: functions[0].entrypoint: './handler.main': '..', '.' and empty path segments "
        "are not allowed",
    ),
    bad(
        "entrypoint-absolute",
        one(entrypoint="/etc/handler.main"),
        f"{M}:4: functions[0].entrypoint: '/etc/handler.main' is an absolute path; give a path "
        "inside the folder",
    ),
    bad(
        "entrypoint-file-missing",
        one(entrypoint="nope.main"),
        f"{M}:4: functions[0].entrypoint: fn/nope.py does not exist (runtime python3.11)",
    ),
    bad(
        "entrypoint-js-file-for-python",
        {"fn/sless.yaml": manifest_text(), "fn/handler.js": NODE_HANDLER},
        f"{M}:4: functions[0].entrypoint: fn/handler.py does not exist (runtime python3.11)",
    ),
    bad(
        "entrypoint-py-file-for-node",
        one(runtime="nodejs20"),
        f"{M}:4: functions[0].entrypoint: fn/handler.js does not exist (runtime nodejs20)",
    ),
    bad(
        "entrypoint-names-a-folder",
        one(entrypoint="lib.main") | {"fn/lib/handler.py": HANDLER},
        f"{M}:4: functions[0].entrypoint: fn/lib.py does not exist (runtime python3.11)",
    ),
    bad(
        "unknown-runtime",
        one(runtime="python2"),
        f'{M}:3: functions[0].runtime: "python2" is not one of {RUNTIMES}',
    ),
    # --- unknown keys -------------------------------------------------------------------
    bad(
        "unknown-top-level-key",
        repo(manifest_text() + "version: 2\n"),
        f"{M}:5: version: unknown field; known fields: functions",
    ),
    bad(
        "unknown-function-field",
        one("    memoryMb: 256"),
        f"{M}:5: functions[0].memoryMb: unknown field; did you mean 'memoryMB'?",
    ),
    bad(
        "unknown-function-field-no-hint",
        one("    color: blue"),
        f"{M}:5: functions[0].color: unknown field; known fields: {KNOWN_FUNCTION_FIELDS}",
    ),
    bad(
        "http-trigger-unknown-field",
        one("    triggers:", "      - type: http", "        path: /hello"),
        f"{M}:7: functions[0].triggers[0].path: unknown field; known fields: type, sameOrigin",
    ),
    bad(
        "http-trigger-with-schedule",
        one("    triggers:", "      - type: http", "        schedule: '0 2 * * *'"),
        f"{M}:7: functions[0].triggers[0].schedule: unknown field; known fields: type, sameOrigin",
    ),
    # --- names --------------------------------------------------------------------------
    bad(
        "uppercase-name",
        one(name="Notes"),
        f'{M}:2: functions[0].name: "Notes" {DNS_HINT}',
    ),
    bad(
        "name-starts-with-digit",
        one(name="1fn"),
        f'{M}:2: functions[0].name: "1fn" {DNS_HINT}',
    ),
    bad(
        "name-ends-with-dash",
        one(name="fn-"),
        f'{M}:2: functions[0].name: "fn-" {DNS_HINT}',
    ),
    bad(
        "too-long-name",
        one(name="a" * 41),
        f'{M}:2: functions[0].name: "{"a" * 41}" is 41 characters; the maximum is 40',
    ),
    bad(
        "duplicate-function-in-file",
        repo(
            manifest_text()
            + "  - name: fn\n    runtime: python3.11\n    entrypoint: handler.main\n"
        ),
        f"{M}:2: functions[0].name: function name 'fn' is also used by a function at {M}:5",
        f"{M}:5: functions[1].name: function name 'fn' is already used by a function at {M}:2",
    ),
    bad(
        "duplicate-function-across-files",
        {
            "a/sless.yaml": manifest_text(),
            "a/handler.py": HANDLER,
            "b/sless.yaml": manifest_text(),
            "b/handler.py": HANDLER,
        },
        "a/sless.yaml:2: functions[0].name: function name 'fn' is also used by a function at "
        "b/sless.yaml:2",
        "b/sless.yaml:2: functions[0].name: function name 'fn' is already used by a function at "
        "a/sless.yaml:2",
    ),
    bad(
        "job-named-like-function",
        one("    jobs:", "      - name: fn", "        runId: 1"),
        f"{M}:2: functions[0].name: function name 'fn' is also used by a job at {M}:6",
        f"{M}:6: functions[0].jobs[0].name: job name 'fn' is already used by a function at {M}:2",
    ),
    bad(
        "job-named-like-function-in-other-file",
        {
            "a/sless.yaml": manifest_text(name="report"),
            "a/handler.py": HANDLER,
            "b/sless.yaml": manifest_text("    jobs:", "      - name: report", "        runId: 1"),
            "b/handler.py": HANDLER,
        },
        "a/sless.yaml:2: functions[0].name: function name 'report' is also used by a job at "
        "b/sless.yaml:6",
        "b/sless.yaml:6: functions[0].jobs[0].name: job name 'report' is already used by a "
        "function at a/sless.yaml:2",
    ),
    bad(
        "duplicate-job-names",
        one(
            "    jobs:",
            "      - name: setup",
            "        runId: 1",
            "      - name: setup",
            "        runId: 2",
        ),
        f"{M}:6: functions[0].jobs[0].name: job name 'setup' is also used by a job at {M}:8",
        f"{M}:8: functions[0].jobs[1].name: job name 'setup' is already used by a job at {M}:6",
    ),
    bad(
        "uppercase-job-name",
        one("    jobs:", "      - name: Setup", "        runId: 1"),
        f'{M}:6: functions[0].jobs[0].name: "Setup" {DNS_HINT}',
    ),
    # --- env ----------------------------------------------------------------------------
    bad(
        "env-reserved-name",
        one("    env:", "      SLESS_X: x"),
        f'{M}:6: functions[0].env.SLESS_X: name "SLESS_X" {ENV_NAME_HINT}',
    ),
    bad(
        "env-name-with-dash",
        one("    env:", "      MY-VAR: x"),
        f'{M}:6: functions[0].env.MY-VAR: name "MY-VAR" {ENV_NAME_HINT}',
    ),
    bad(
        "preview-env-reserved-name",
        one("    preview:", "      env:", "        SLESS_ENTRYPOINT: x"),
        f"{M}:7: functions[0].preview.env.SLESS_ENTRYPOINT: name "
        f'"SLESS_ENTRYPOINT" {ENV_NAME_HINT}',
    ),
    bad(
        "env-number-literal",
        one("    env:", "      PORT: 8080"),
        f"{M}:6: functions[0].env.PORT: 8080 is a number; expected a string (quote it)",
    ),
    bad(
        "env-boolean-literal",
        one("    env:", "      DEBUG: true"),
        f"{M}:6: functions[0].env.DEBUG: true is a boolean; expected a string (quote it)",
    ),
    bad(
        "preview-env-number-literal",
        one("    preview:", "      env:", "        RATE: 0.5"),
        f"{M}:7: functions[0].preview.env.RATE: 0.5 is a number; expected a string (quote it)",
    ),
    bad(
        "env-secret-ref-unknown-key",
        one("    env:", "      PG_DSN: {secret: notes-db, key: dsn, optional: true}"),
        f"{M}:6: functions[0].env.PG_DSN.optional: unknown field; known fields: secret, key",
    ),
    bad(
        "env-secret-ref-misspelt",
        one("    env:", "      PG_DSN: {secrt: notes-db, key: dsn}"),
        f"{M}:6: functions[0].env.PG_DSN.secret: is required",
        f"{M}:6: functions[0].env.PG_DSN.secrt: unknown field; did you mean 'secret'?",
    ),
    bad(
        "env-job-ref-unknown-key",
        one(
            "    env:",
            "      T: {job: setup, key: x}",
            "    jobs:",
            "      - name: setup",
            "        runId: 1",
        ),
        f"{M}:6: functions[0].env.T.key: unknown field; known fields: job",
    ),
    bad(
        "env-secret-name-invalid",
        one("    env:", "      PG_DSN: {secret: Notes_DB, key: dsn}"),
        f'{M}:6: functions[0].env.PG_DSN.secret: "Notes_DB" must be a Kubernetes Secret name '
        "(DNS-1123 subdomain)",
    ),
    bad(
        "env-job-ref-to-nothing",
        one("    env:", "      T: {job: nope}"),
        f"{M}:6: functions[0].env.T.job: job 'nope' is not defined in this repository",
    ),
    bad(
        "preview-env-job-ref-to-nothing",
        one("    preview:", "      env:", "        T: {job: nope}"),
        f"{M}:7: functions[0].preview.env.T.job: job 'nope' is not defined in this repository",
    ),
    # --- triggers -----------------------------------------------------------------------
    bad(
        "unknown-trigger-type",
        one("    triggers:", "      - type: kafka"),
        f'{M}:6: functions[0].triggers[0].type: "kafka" is not one of "http", "cron", "queue",'
        ' "websocket"',
    ),
    bad(
        "queue-trigger-without-subject",
        one("    triggers:", "      - type: queue"),
        f"{M}:6: functions[0].triggers[0].subject: is required",
    ),
    bad(
        "queue-subject-wildcard",
        one("    triggers:", "      - {type: queue, subject: 'orders.>'}"),
        f'{M}:6: functions[0].triggers[0].subject: "orders.>" must be tokens of letters, '
        "digits, '-' and '_' separated by dots (orders.created), without wildcards",
    ),
    bad(
        "async-max-age-too-short",
        one("    async: {maxAge: 10s}"),
        f'{M}:5: functions[0].async.maxAge: "10s" is less than the minimum of 1m',
    ),
    bad(
        "async-unknown-field",
        one("    async: {retry: 3}"),
        f"{M}:5: functions[0].async.retry: unknown field; did you mean 'retries'?",
    ),
    bad(
        "rollout-steps-not-increasing",
        one("    rollout:", "      steps: [10, 50, 50, 30]"),
        f"{M}:6: functions[0].rollout.steps[2]: 50 after 50: the steps must increase",
        f"{M}:6: functions[0].rollout.steps[3]: 30 after 50: the steps must increase",
    ),
    bad(
        "rollout-step-of-100",
        one("    rollout: {steps: [100]}"),
        f"{M}:5: functions[0].rollout.steps[0]: 100 is greater than the maximum of 99",
    ),
    bad(
        "rollout-interval-too-long",
        one("    rollout: {interval: 2d}"),
        f'{M}:5: functions[0].rollout.interval: "2d" is greater than the maximum of 1d',
    ),
    bad(
        "rollout-error-rate-over-one",
        one("    rollout: {maxErrorRate: 5}"),
        f"{M}:5: functions[0].rollout.maxErrorRate: 5 is greater than the maximum of 1",
    ),
    bad(
        "stream-idle-of-zero",
        one("    stream: {idleSec: 0}"),
        f"{M}:5: functions[0].stream.idleSec: 0 is less than the minimum of 1",
    ),
    bad(
        "stream-unknown-field",
        one("    stream:", "      maxSeconds: 60"),
        f"{M}:6: functions[0].stream.maxSeconds: unknown field; did you mean 'maxSec'?",
    ),
    bad(
        "websocket-hook-not-defined",
        one("    triggers:", "      - {type: websocket, onConnect: hello}"),
        f"{M}:6: functions[0].triggers[0].onConnect: fn/handler.py defines no 'hello' at module"
        " level (it defines main)",
    ),
    bad(
        "websocket-hook-not-a-name",
        one("    triggers:", "      - {type: websocket, onDisconnect: 'handler.bye'}"),
        f'{M}:6: functions[0].triggers[0].onDisconnect: "handler.bye" must be the name of a'
        " function in the entrypoint's file (letters, digits, '_' and '$', not starting with a"
        " digit)",
    ),
    bad(
        "websocket-message-limit-of-zero",
        one("    triggers:", "      - {type: websocket, maxMessageBytes: 0}"),
        f"{M}:6: functions[0].triggers[0].maxMessageBytes: 0 is less than the minimum of 1",
    ),
    bad(
        "two-websocket-triggers",
        one("    triggers:", "      - type: websocket", "      - type: websocket"),
        f"{M}:7: functions[0].triggers[1]: a function has at most one websocket trigger",
    ),
    bad(
        "stream-drain-negative",
        one("    stream: {drainSec: -1}"),
        f"{M}:5: functions[0].stream.drainSec: -1 is less than the minimum of 0",
    ),
    bad(
        "two-http-triggers",
        one("    triggers:", "      - type: http", "      - type: http"),
        f"{M}:7: functions[0].triggers[1]: a function has at most one http trigger",
    ),
    bad(
        "cron-four-fields",
        cron("* * * *"),
        f"{M}:7: functions[0].triggers[0].schedule: '* * * *' has 4 fields; {CRON_FIELDS}",
    ),
    bad(
        "cron-four-long-fields",
        cron("30 2 1 jan"),
        f"{M}:7: functions[0].triggers[0].schedule: '30 2 1 jan' has 4 fields; {CRON_FIELDS}",
    ),
    bad(
        "cron-six-fields",
        cron("0 0 2 * * *"),
        f"{M}:7: functions[0].triggers[0].schedule: '0 0 2 * * *' has 6 fields; {CRON_FIELDS}",
    ),
    bad(
        "cron-minute-60",
        cron("60 * * * *"),
        f"{M}:7: functions[0].triggers[0].schedule: minute field: 60 is out of range 0..59",
    ),
    bad(
        "cron-day-of-week-7",
        cron("0 0 * * 7"),
        f"{M}:7: functions[0].triggers[0].schedule: day-of-week field: 7 is out of range 0..6 "
        "(0 = Sunday; use 0, not 7)",
    ),
    bad(
        "cron-step-zero",
        cron("*/0 * * * *"),
        f"{M}:7: functions[0].triggers[0].schedule: minute field: step '0' must be a positive "
        "number",
    ),
    bad(
        "cron-backwards-range",
        cron("0 5-2 * * *"),
        f"{M}:7: functions[0].triggers[0].schedule: hour field: range '5-2' runs backwards",
    ),
    bad(
        "cron-garbage",
        cron("every day ok"),
        f"{M}:7: functions[0].triggers[0].schedule: 'every day ok' has 3 fields; {CRON_FIELDS}",
    ),
    bad(
        "cron-garbage-fields",
        cron("a b c d e"),
        f"{M}:7: functions[0].triggers[0].schedule: minute field: 'a' is not a number",
    ),
    bad(
        "cron-unicode-digit",
        cron("² * * * *"),
        f"{M}:7: functions[0].triggers[0].schedule: minute field: '²' is not a number",
    ),
    # --- YAML ---------------------------------------------------------------------------
    bad(
        "yaml-syntax-error",
        one("    memoryMB: 128: 256"),
        f"{M}:5: (file): YAML syntax error: mapping values are not allowed here",
    ),
    bad(
        "yaml-tab-indent",
        one("\tmemoryMB: 128"),
        f"{M}:5: (file): YAML syntax error: found character '\\t' that cannot start any token",
    ),
    bad(
        "duplicate-yaml-key",
        one("    memoryMB: 128", "    memoryMB: 256"),
        f"{M}:6: functions[0].memoryMB: duplicate key (first at line 5)",
    ),
    bad(
        "alias-bomb",
        repo(ALIAS_BOMB),
        f"{M}:1: x4[0][6][8][8][8]: document expands to more than 20000 values (alias bomb?)",
    ),
    bad(
        "recursive-alias",
        repo("functions: &f [*f]\n"),
        f"{M}:1: functions[0]: recursive alias: the value contains itself",
    ),
    bad(
        "recursive-alias-in-mapping",
        repo(
            "functions:\n"
            "  - &fn\n"
            "    name: fn\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    env:\n"
            "      SELF: *fn\n"
        ),
        f"{M}:7: functions[0].env.SELF: recursive alias: the value contains itself",
    ),
    bad(
        "python-object-tag",
        one("    env: !!python/object:os.system {}"),
        f"{M}:5: functions[0].env: unsupported YAML tag !!python/object:os.system",
    ),
    bad(
        "custom-tag",
        one("    memoryMB: !mebibytes 256"),
        f"{M}:5: functions[0].memoryMB: unsupported YAML tag !mebibytes",
    ),
    bad(
        "set-tag",
        one("    env: !!set {A}"),
        f"{M}:5: functions[0].env: unsupported YAML tag !!set",
    ),
    bad(
        "non-string-key",
        one("    env:", "      1: x"),
        f"{M}:6: functions[0].env: key 1 is not a string; quote it",
    ),
    bad(
        "boolean-key",
        one("    env:", "      yes: x"),
        f"{M}:6: functions[0].env: key yes is not a string; quote it",
    ),
    bad(
        "bad-merge-key",
        one("    <<: 5"),
        f"{M}:5: functions[0]: a merge key (<<) needs a mapping or a list of mappings",
    ),
    bad(
        "too-deeply-nested",
        one(
            "    jobs:",
            "      - name: setup",
            "        runId: 1",
            "        event: {deep: " + "[" * 70 + "]" * 70 + "}",
        ),
        f"{M}:8: functions[0].jobs[0].event.deep" + "[0]" * 59 + ": nested deeper than 64 levels",
    ),
    bad(
        "huge-file",
        repo(manifest_text() + "# " + "x" * (256 * 1024) + "\n"),
        f"{M}:1: (file): file is {len(manifest_text()) + 2 + 256 * 1024 + 1} bytes; "
        "the limit is 262144",
    ),
    bad(
        "non-utf8",
        repo(manifest_text("    env:").encode() + b'      GREETING: "gr\xfc\xdf"\n'),
        f"{M}:6: (file): not valid UTF-8 (byte 0xfc)",
    ),
    bad(
        "multiple-documents",
        repo(manifest_text() + "---\n" + manifest_text(name="other")),
        f"{M}:6: (file): more than one YAML document",
    ),
    bad(
        "empty-file",
        repo(""),
        f"{M}:1: functions: is required (the file is empty)",
    ),
    bad(
        "comments-only",
        repo("# functions: later\n"),
        f"{M}:1: functions: is required (the file is empty)",
    ),
    bad(
        "top-level-list",
        repo("- name: fn\n  runtime: python3.11\n"),
        f'{M}:1: (root): [{{"name": "fn", "runtime": "python3.11"}}] is a list; expected a mapping',
    ),
    bad(
        "top-level-string",
        repo("hello\n"),
        f'{M}:1: (root): "hello" is a string; expected a mapping',
    ),
    # --- symlinks -----------------------------------------------------------------------
    bad(
        "symlink-outside-folder",
        one(),
        f"{M}:1: (folder): symlink passwd -> ../../etc/passwd points outside the function folder",
        links={"fn/passwd": "../../etc/passwd"},
    ),
    bad(
        "symlink-outside-folder-from-subfolder",
        one(),
        f"{M}:1: (folder): symlink lib/shared.py -> ../../shared.py points outside the "
        "function folder",
        links={"fn/lib/shared.py": "../../shared.py"},
    ),
    bad(
        "absolute-symlink",
        one(),
        f"{M}:1: (folder): symlink passwd -> /etc/passwd is an absolute path",
        links={"fn/passwd": "/etc/passwd"},
    ),
    bad(
        "manifest-is-a-symlink",
        {"fn/real.yaml": manifest_text(), "fn/handler.py": HANDLER},
        f"{M}:1: (file): sless.yaml must be a regular file, not a link",
        links={"fn/sless.yaml": "real.yaml"},
    ),
    # --- several problems in one file ---------------------------------------------------
    bad(
        "many-problems",
        one("    memoryMB: -10", "    timeoutSec: 0", "    colour: blue", "    replicas: 21"),
        f"{M}:5: functions[0].memoryMB: -10 is less than the minimum of 64",
        f"{M}:6: functions[0].timeoutSec: 0 is less than the minimum of 1",
        f"{M}:7: functions[0].colour: unknown field; known fields: {KNOWN_FUNCTION_FIELDS}",
        f"{M}:8: functions[0].replicas: 21 is greater than the maximum of 20",
    ),
]


def load_dir(root: Path) -> DesiredState:
    return manifest.load(DirectorySnapshot(root))


@pytest.mark.parametrize(("files", "links", "expected"), BAD_CASES)
def test_bad_manifest(
    write_repo, files: dict[str, str | bytes], links: dict[str, str], expected: list[str]
) -> None:
    root = write_repo(files)
    make_links(root, links)
    state = load_dir(root)
    assert problem_lines(state) == expected
    assert state.functions == {}
    assert sorted(state.invalid) == sorted({line.split(":", 1)[0] for line in expected})


GIT_CASE_IDS = {
    "symlink-outside-folder",
    "absolute-symlink",
    "manifest-is-a-symlink",
    "entrypoint-file-missing",
    "duplicate-function-across-files",
    "non-utf8",
    "cron-day-of-week-7",
}


@pytest.mark.parametrize(
    ("files", "links", "expected"), [case for case in BAD_CASES if case.id in GIT_CASE_IDS]
)
def test_bad_manifest_in_git_commit(
    write_repo, files: dict[str, str | bytes], links: dict[str, str], expected: list[str]
) -> None:
    root = write_repo(files)
    make_links(root, links)
    git_commit_all(root)
    snapshot = open_snapshot(root)
    assert isinstance(snapshot, GitSnapshot)
    state = manifest.load(snapshot)
    assert problem_lines(state) == expected
    assert state.functions == {}


def test_alias_bomb_is_refused_before_it_is_expanded(write_repo) -> None:
    # expanded, it would be billions of nodes (this test would never end): the refusal
    # comes from counting aliases, and says so
    root = write_repo(repo(ALIAS_BOMB))
    state = load_dir(root)
    [problem] = state.problems
    assert "alias bomb" in problem.reason


@pytest.mark.parametrize(
    ("text", "line", "field", "shown"),
    [
        pytest.param(
            manifest_text("    memoryMB: !!int lots"),
            5,
            "functions[0].memoryMB",
            "lots",
            id="int-tag-on-text",
        ),
        pytest.param(
            manifest_text("    memoryMB: !!float lots"),
            5,
            "functions[0].memoryMB",
            "lots",
            id="float-tag-on-text",
        ),
        pytest.param(
            manifest_text("    enabled: !!bool maybe"),
            5,
            "functions[0].enabled",
            "maybe",
            id="bool-tag-on-text",
        ),
        pytest.param(
            manifest_text("    env:", '      A: "a\x00b"'),
            6,
            "(file)",
            "#x0000",
            id="nul-character",
        ),
        pytest.param(
            manifest_text("    env:", "      A: a\x07b"),
            6,
            "(file)",
            "#x0007",
            id="control-character",
        ),
    ],
)
def test_unreadable_value_is_a_problem_not_a_crash(
    write_repo, text: str, line: int, field: str, shown: str
) -> None:
    """Input PyYAML itself chokes on is still one located, one-line problem."""
    state = load_dir(write_repo(repo(text)))
    [problem] = state.problems
    assert (problem.path, problem.line, problem.field) == (M, line, field)
    assert shown in problem.reason
    assert "\n" not in str(problem)


def test_one_bad_manifest_does_not_stop_the_others(write_repo) -> None:
    root = write_repo(
        {
            "good/sless.yaml": manifest_text(name="good")
            + "  - name: good-too\n    runtime: python3.11\n    entrypoint: handler.main\n",
            "good/handler.py": HANDLER,
            "bad/sless.yaml": manifest_text("    memoryMB: -10", name="broken"),
            "bad/handler.py": HANDLER,
            "unreadable/sless.yaml": "functions: [\n",
            "unreadable/handler.py": HANDLER,
        }
    )
    state = load_dir(root)
    assert sorted(state.functions) == ["good", "good-too"]
    assert sorted(state.invalid) == ["bad/sless.yaml", "unreadable/sless.yaml"]
    assert state.invalid_names == {"broken": "bad/sless.yaml"}
    assert [str(p) for p in state.invalid["bad/sless.yaml"].problems] == [
        "bad/sless.yaml:5: functions[0].memoryMB: -10 is less than the minimum of 64"
    ]
    assert str(state.invalid["bad/sless.yaml"]) == (
        "bad/sless.yaml:5: functions[0].memoryMB: -10 is less than the minimum of 64"
    )


# --- valid manifests ----------------------------------------------------------------------

DEFAULTS: dict[str, Any] = {
    "name": "fn",
    "folder": "fn",
    "manifest": "fn/sless.yaml",
    "runtime": "python3.11",
    "entrypoint": "handler.main",
    "memory_mb": 128,
    "timeout_sec": 30,
    "replicas": 1,
    "enabled": True,
    "env": {},
    "preview_env": {},
    "http": False,
    "crons": (),
    "jobs": (),
}

ALL_FIELDS = """\
functions:
  - name: notes
    runtime: python3.11
    entrypoint: notes_crud.crud
    memoryMB: 512
    timeoutSec: 60
    replicas: 3
    enabled: false
    env:
      GREETING: "hello"
      PG_DSN: {secret: notes-db, key: dsn}
      JOB_TIME: {job: notes-create-table}
    triggers:
      - type: http
      - type: cron
        schedule: "0 2 * * *"
        event: {report: daily}
      - type: cron
        schedule: "*/5 * * * *"
    jobs:
      - name: notes-create-table
        runId: 1
        event: {statements: ["CREATE TABLE IF NOT EXISTS notes (id int)"]}
      - name: notes-seed
        runId: 0
    preview:
      env:
        PG_DSN: {secret: notes-db-preview, key: dsn}
"""

MERGE_KEYS = """\
functions:
  - &defaults
    name: first
    runtime: python3.11
    entrypoint: handler.main
    memoryMB: 256
    env: &env
      A: "1"
      B: "2"
  - <<: *defaults
    name: second
    env:
      <<: *env
      B: "3"
"""

MERGE_OF_MERGE = """\
functions:
  - &base
    name: first
    runtime: python3.11
    entrypoint: handler.main
    memoryMB: 256
  - &second
    <<: *base
    name: second
  - <<: *second
    name: third
"""


def good(
    id: str,
    files: dict[str, str | bytes],
    name: str = "fn",
    links: Mapping[str, str] | None = None,
    **expected: Any,
) -> Any:
    expected = {**DEFAULTS, "name": name, **expected}
    return pytest.param(files, dict(links or {}), name, expected, id=id)


GOOD_CASES = [
    good("defaults", one()),
    good("stream-defaults", one("    stream: {}"), stream=model.StreamPolicy(30, 900, 30)),
    good(
        "stream-drain",
        one("    stream: {drainSec: 0}"),
        stream=model.StreamPolicy(30, 900, 0),
    ),
    good(
        "websocket-only",
        one("    triggers:", "      - {type: websocket, onConnect: main, onDisconnect: main}"),
        http=True,
        plain_http=False,
        websocket=model.WebSocketTrigger("main", "main", 1048576),
    ),
    good(
        "websocket-and-http",
        one(
            "    triggers:", "      - type: http", "      - {type: websocket, maxMessageBytes: 64}"
        ),
        http=True,
        websocket=model.WebSocketTrigger(None, None, 64),
    ),
    good("stream", one("    stream: {idleSec: 5, maxSec: 60}"), stream=model.StreamPolicy(5, 60)),
    good(
        "every-field",
        repo(ALL_FIELDS) | {"fn/notes_crud.py": CRUD_HANDLER},
        name="notes",
        entrypoint="notes_crud.crud",
        memory_mb=512,
        timeout_sec=60,
        replicas=3,
        enabled=False,
        env={
            "GREETING": "hello",
            "JOB_TIME": JobRef("notes-create-table"),
            "PG_DSN": SecretRef("notes-db", "dsn"),
        },
        preview_env={"PG_DSN": SecretRef("notes-db-preview", "dsn")},
        http=True,
        crons=(
            CronTrigger("0 2 * * *", {"report": "daily"}),
            CronTrigger("*/5 * * * *", {}),
        ),
        jobs=(
            Job(
                "notes-create-table",
                1,
                {"statements": ["CREATE TABLE IF NOT EXISTS notes (id int)"]},
                "notes",
            ),
            Job("notes-seed", 0, {}, "notes"),
        ),
    ),
    good(
        "smallest-values",
        one("    memoryMB: 64", "    timeoutSec: 1", "    replicas: 0"),
        memory_mb=64,
        timeout_sec=1,
        replicas=0,
    ),
    good(
        "largest-values",
        one("    memoryMB: 4096", "    timeoutSec: 900", "    replicas: 20"),
        memory_mb=4096,
        timeout_sec=900,
        replicas=20,
    ),
    good("enabled-true", one("    enabled: true")),
    good("enabled-false", one("    enabled: false"), enabled=False),
    good(
        "run-ids-at-the-bounds",
        one(
            "    jobs:",
            "      - name: never",
            "        runId: 0",
            "      - name: last",
            "        runId: 2147483647",
        ),
        jobs=(Job("never", 0, {}, "fn"), Job("last", 2147483647, {}, "fn")),
    ),
    good("one-letter-name", one(name="a"), name="a"),
    good("forty-character-name", one(name="a" * 40), name="a" * 40),
    good("name-with-digits-and-dashes", one(name="get-v2-x9"), name="get-v2-x9"),
    good(
        "nodejs-runtime",
        {"fn/sless.yaml": manifest_text(runtime="nodejs20"), "fn/handler.js": NODE_HANDLER},
        runtime="nodejs20",
    ),
    good(
        "entrypoint-with-dash-and-slash",
        one(entrypoint="lib/my-mod.main") | {"fn/lib/my-mod.py": HANDLER},
        entrypoint="lib/my-mod.main",
    ),
    good(
        "node-entrypoint-in-subfolder",
        {
            "fn/sless.yaml": manifest_text(runtime="nodejs20", entrypoint="src/index.$handle_2"),
            "fn/src/index.js": "exports.$handle_2 = async (event) => event;\n",
        },
        runtime="nodejs20",
        entrypoint="src/index.$handle_2",
    ),
    good(
        "env-literals",
        one(
            "    env:",
            '      PORT: "8080"',
            "      DEBUG: 'true'",
            '      EMPTY: ""',
            "      PLAIN: hello world",
            '      UNICODE: "grüß ✓"',
            "      lower_case: x",
            "      _LEADING: y",
            "      DAY: 2024-01-01",
        ),
        env={
            "DAY": "2024-01-01",
            "DEBUG": "true",
            "EMPTY": "",
            "PLAIN": "hello world",
            "PORT": "8080",
            "UNICODE": "grüß ✓",
            "_LEADING": "y",
            "lower_case": "x",
        },
    ),
    good(
        "env-references",
        one(
            "    env:",
            "      DSN: {secret: notes-db.v1, key: pg.dsn}",
            "      TIME: {job: time-getter}",
            "    jobs:",
            "      - name: time-getter",
            "        runId: 1",
        ),
        env={"DSN": SecretRef("notes-db.v1", "pg.dsn"), "TIME": JobRef("time-getter")},
        jobs=(Job("time-getter", 1, {}, "fn"),),
    ),
    good(
        "job-defined-in-another-folder",
        {
            **one("    env:", "      TIME: {job: time-getter}"),
            "getter/sless.yaml": manifest_text(
                "    jobs:", "      - name: time-getter", "        runId: 3", name="getter"
            ),
            "getter/handler.py": HANDLER,
        },
        env={"TIME": JobRef("time-getter")},
    ),
    good("http-trigger", one("    triggers:", "      - type: http"), http=True),
    good(
        "cron-trigger-without-event",
        one("    triggers:", "      - type: cron", "        schedule: '0 9 * * mon-fri'"),
        crons=(CronTrigger("0 9 * * mon-fri", {}),),
    ),
    good(
        "cron-trigger-names-and-lists",
        one("    triggers:", "      - type: cron", "        schedule: '0 0 * jan,jul sun'"),
        crons=(CronTrigger("0 0 * jan,jul sun", {}),),
    ),
    good(
        "empty-collections",
        one("    env: {}", "    triggers: []", "    jobs: []", "    preview: {}"),
    ),
    good(
        "preview-env-only",
        one("    preview:", "      env:", '        MODE: "preview"'),
        preview_env={"MODE": "preview"},
    ),
    good("merge-keys", repo(MERGE_KEYS), name="first", memory_mb=256, env={"A": "1", "B": "2"}),
    good(
        "merge-keys-override",
        repo(MERGE_KEYS),
        name="second",
        memory_mb=256,
        env={"A": "1", "B": "3"},
    ),
    good("merge-of-a-merge", repo(MERGE_OF_MERGE), name="third", memory_mb=256),
    good(
        "flow-style",
        repo("{functions: [{name: fn, runtime: python3.11, entrypoint: handler.main}]}\n"),
    ),
    good("document-marker-and-comments", repo("# notes\n---\n" + manifest_text("# end"))),
    good("utf8-bom", repo(b"\xef\xbb\xbf" + manifest_text().encode())),
    good(
        "symlink-inside-folder",
        one(entrypoint="lib/alias.main"),
        entrypoint="lib/alias.main",
        links={"fn/lib/alias.py": "../handler.py", "fn/current": "lib"},
    ),
    good(
        "manifest-at-repository-root",
        {"sless.yaml": manifest_text(), "handler.py": HANDLER},
        folder="",
        manifest="sless.yaml",
    ),
    good(
        "deeply-nested-folder",
        {"a/b/c/fn/sless.yaml": manifest_text(), "a/b/c/fn/handler.py": HANDLER},
        folder="a/b/c/fn",
        manifest="a/b/c/fn/sless.yaml",
    ),
]


@pytest.mark.parametrize(("files", "links", "name", "expected"), GOOD_CASES)
def test_valid_manifest(
    write_repo,
    files: dict[str, str | bytes],
    links: dict[str, str],
    name: str,
    expected: dict[str, Any],
) -> None:
    root = write_repo(files)
    make_links(root, links)
    state = load_dir(root)
    assert problem_lines(state) == []
    assert state.invalid == {}
    assert state.invalid_names == {}
    fn = state.functions[name]
    actual = {key: getattr(fn, key) for key in expected}
    actual["env"] = dict(fn.env)
    actual["preview_env"] = dict(fn.preview_env)
    assert actual == expected


def test_whole_numbers_written_with_a_point_load_as_ints(write_repo) -> None:
    """The schema's "integer" accepts 256.0; the loaded function must hold ints, not floats."""
    root = write_repo(
        one(
            "    memoryMB: 256.0",
            "    timeoutSec: 10.0",
            "    replicas: 2.0",
            "    jobs:",
            "      - name: setup",
            "        runId: 1.0",
        )
    )
    fn = load_dir(root).functions["fn"]
    values = (fn.memory_mb, fn.timeout_sec, fn.replicas, fn.jobs[0].run_id)
    assert values == (256, 10, 2, 1)
    assert [type(v) for v in values] == [int, int, int, int]


def test_functions_of_one_folder_share_source_id_and_build_tag(write_repo) -> None:
    root = write_repo(
        {
            "shop/sless.yaml": (
                "functions:\n"
                "  - {name: cart, runtime: python3.11, entrypoint: cart.main}\n"
                "  - {name: checkout, runtime: python3.11, entrypoint: checkout.main}\n"
                "  - {name: widget, runtime: nodejs20, entrypoint: widget.main}\n"
            ),
            "shop/cart.py": HANDLER,
            "shop/checkout.py": HANDLER,
            "shop/widget.js": NODE_HANDLER,
            "other/sless.yaml": manifest_text(name="other"),
            "other/handler.py": HANDLER,
        }
    )
    fns = load_dir(root).functions
    assert sorted(fns) == ["cart", "checkout", "other", "widget"]
    assert fns["cart"].source_id == fns["checkout"].source_id == fns["widget"].source_id
    assert fns["cart"].build_tag == fns["checkout"].build_tag
    assert fns["widget"].build_tag != fns["cart"].build_tag  # another runtime, another image
    assert fns["cart"].build_tag.startswith("python3.11-")
    assert fns["widget"].build_tag.startswith("nodejs20-")
    assert fns["other"].source_id != fns["cart"].source_id
    assert fns["other"].build_tag != fns["cart"].build_tag
    assert {fn.folder for fn in fns.values()} == {"shop", "other"}


def test_preview_env_overrides_apply_only_in_previews(write_repo) -> None:
    root = write_repo(
        one(
            "    env:",
            '      GREETING: "hello"',
            "      PG_DSN: {secret: notes-db, key: dsn}",
            "    preview:",
            "      env:",
            "        PG_DSN: {secret: notes-db-preview, key: dsn}",
            '        DEBUG: "1"',
        )
    )
    fn = load_dir(root).functions["fn"]
    assert fn.env_for("prod") == {
        "GREETING": "hello",
        "PG_DSN": SecretRef("notes-db", "dsn"),
    }
    assert fn.env_for("staging") == fn.env_for("prod")
    preview = fn.env_for("pr-7")
    assert preview == {
        "DEBUG": "1",
        "GREETING": "hello",
        "PG_DSN": SecretRef("notes-db-preview", "dsn"),
    }
    assert list(preview) == sorted(preview)
    assert model.is_preview("pr-7")
    assert not model.is_preview("prod")


def test_job_references_become_job_dependencies(write_repo) -> None:
    root = write_repo(
        {
            **one(
                "    env:",
                "      TIME: {job: time-getter}",
                "      SEED: {job: seed}",
                "    preview:",
                "      env:",
                "        SEED: {secret: fake-seed, key: value}",
                "        FIXTURES: {job: preview-fixtures}",
                name="time-display",
            ),
            "jobs/sless.yaml": manifest_text(
                "    jobs:",
                "      - name: time-getter",
                "        runId: 1",
                "      - name: seed",
                "        runId: 0",
                "      - name: preview-fixtures",
                "        runId: 2",
                "        event: {rows: 10}",
                name="jobs-runner",
            ),
            "jobs/handler.py": HANDLER,
        }
    )
    state = load_dir(root)
    assert problem_lines(state) == []
    display = state.functions["time-display"]
    assert display.job_dependencies("prod") == ["seed", "time-getter"]
    assert display.job_dependencies("pr-7") == ["preview-fixtures", "time-getter"]
    assert state.functions["jobs-runner"].job_dependencies("prod") == []
    assert state.jobs == {
        "time-getter": Job("time-getter", 1, {}, "jobs-runner"),
        "seed": Job("seed", 0, {}, "jobs-runner"),
        "preview-fixtures": Job("preview-fixtures", 2, {"rows": 10}, "jobs-runner"),
    }


# --- directory and git agree; identity ----------------------------------------------------

IDENTITY_REPO: dict[str, str | bytes] = {
    "README.md": "# functions\n",
    "notes/sless.yaml": (
        "functions:\n"
        "  - name: notes\n"
        "    runtime: python3.11\n"
        "    entrypoint: notes_crud.crud\n"
        "    env:\n"
        "      PG_DSN: {secret: notes-db, key: dsn}\n"
        "      READY: {job: notes-setup}\n"
        "    triggers:\n"
        "      - type: http\n"
        "    jobs:\n"
        "      - name: notes-setup\n"
        "        runId: 1\n"
        "  - name: notes-admin\n"
        "    runtime: python3.11\n"
        "    entrypoint: lib/admin-tools.main\n"
    ),
    "notes/notes_crud.py": CRUD_HANDLER,
    "notes/lib/admin-tools.py": HANDLER,
    "notes/lib.py": "# a file named like a folder: git sorts 'lib' as 'lib/'\n",
    "notes/lib-extra.py": "X = 1\n",
    "notes/lib0.py": "Y = 2\n",
    "notes/requirements.txt": "requests==2.32.3\n",
    "clock/node/sless.yaml": (
        "functions:\n"
        "  - name: clock\n"
        "    runtime: nodejs20\n"
        "    entrypoint: clock.show\n"
        "    triggers:\n"
        "      - type: cron\n"
        "        schedule: '*/5 * * * *'\n"
        "        event: {tz: UTC}\n"
    ),
    "clock/node/clock.js": "exports.show = async (event) => event;\n",
    "clock/node/package.json": '{"name": "clock", "version": "1.0.0"}\n',
    "clock/node/bin/run.sh": "#!/bin/sh\nexec node clock.js\n",
}
IDENTITY_LINKS = {"notes/lib/current.py": "../notes_crud.py"}


def write_identity_repo(write_repo, root: Path) -> Path:
    write_repo(IDENTITY_REPO, root=root)
    make_links(root, IDENTITY_LINKS)
    (root / "clock/node/bin/run.sh").chmod(0o755)
    return root


def test_directory_and_git_commit_give_the_same_functions(write_repo, tmp_path: Path) -> None:
    plain = write_identity_repo(write_repo, tmp_path / "plain")
    committed = write_identity_repo(write_repo, tmp_path / "committed")
    git_commit_all(committed)

    from_dir = open_snapshot(plain)
    from_git = open_snapshot(committed)
    assert isinstance(from_dir, DirectorySnapshot)
    assert isinstance(from_git, GitSnapshot)
    dir_state = manifest.load(from_dir)
    git_state = manifest.load(from_git)

    assert problem_lines(dir_state) == problem_lines(git_state) == []
    assert sorted(dir_state.functions) == ["clock", "notes", "notes-admin"]
    assert dir_state.functions == git_state.functions
    for name, fn in dir_state.functions.items():
        assert fn.source_id == git_state.functions[name].source_id
        assert fn.source_id == git_tree_without_manifest(committed, fn.folder)
    # the work tree of the repository, read as a directory, agrees as well
    assert manifest.load(DirectorySnapshot(committed)).functions == git_state.functions


def test_changing_one_file_changes_only_its_functions_identity(write_repo, tmp_path) -> None:
    root = write_identity_repo(write_repo, tmp_path / "repo")

    def identities() -> dict[str, tuple[str, str]]:
        return {name: (fn.source_id, fn.build_tag) for name, fn in load_dir(root).functions.items()}

    before = identities()
    assert len({ids for ids in before.values()}) == 2  # two folders, two identities

    (root / "notes/lib0.py").write_text("Y = 3\n")
    changed = identities()
    assert changed["clock"] == before["clock"]
    assert changed["notes"] != before["notes"]
    assert changed["notes"][0] != before["notes"][0]
    assert changed["notes"][1] != before["notes"][1]
    assert changed["notes-admin"] == changed["notes"]

    (root / "README.md").write_text("# functions, edited\n")
    assert identities() == changed  # outside every function folder: no function changes

    (root / "clock/node/bin/run.sh").chmod(0o644)
    after_mode = identities()
    assert after_mode["clock"] != changed["clock"]  # the executable bit is part of the tree
    assert after_mode["notes"] == changed["notes"]

    (root / "notes/lib0.py").write_text("Y = 2\n")
    (root / "clock/node/bin/run.sh").chmod(0o755)
    assert identities() == before  # a revert is a cache hit


def test_a_chain_of_links_that_leaves_the_folder_is_refused(write_repo):
    root = write_repo(one())
    make_links(root, {"fn/lib/up": "..", "fn/out": "lib/up/.."})
    state = manifest.load(DirectorySnapshot(root))
    assert [str(p) for p in state.problems] == [
        "fn/sless.yaml:1: (folder): symlink out -> lib/up/.. points outside the function folder"
    ]


def test_a_link_loop_is_refused(write_repo):
    root = write_repo(one())
    make_links(root, {"fn/a": "b", "fn/b": "a"})
    state = manifest.load(DirectorySnapshot(root))
    assert [str(p) for p in state.problems] == [
        "fn/sless.yaml:1: (folder): symlink a -> b points outside the function folder",
        "fn/sless.yaml:1: (folder): symlink b -> a points outside the function folder",
    ]


def test_a_cache_rechecks_only_changed_folders_and_gives_the_same_answers(write_repo):
    root = write_repo(
        {
            "a/sless.yaml": manifest_text(name="a"),
            "a/handler.py": HANDLER,
            "b/sless.yaml": manifest_text("    memoryMB: 1", name="b"),
            "b/handler.py": HANDLER,
        }
    )
    cache = manifest.ManifestCache()
    first = manifest.load(DirectorySnapshot(root), cache)
    again = manifest.load(DirectorySnapshot(root), cache)
    assert again.functions == first.functions
    assert [str(p) for p in again.problems] == [str(p) for p in first.problems]
    assert [str(p) for p in first.problems] == [
        "b/sless.yaml:5: functions[0].memoryMB: 1 is less than the minimum of 64"
    ]
    (root / "b/sless.yaml").write_text(manifest_text(name="b"))
    fixed = manifest.load(DirectorySnapshot(root), cache)
    assert sorted(fixed.functions) == ["a", "b"] and not fixed.invalid
    assert fixed.functions["a"] == first.functions["a"]


def _answers(state: DesiredState) -> tuple[Any, ...]:
    return (
        list(state.functions.items()),  # the order too: a plan follows it
        [(path, [str(p) for p in err.problems]) for path, err in sorted(state.invalid.items())],
        sorted(state.invalid_names.items()),
    )


def test_a_cache_following_commits_answers_as_a_load_from_scratch(tmp_path: Path) -> None:
    """Each commit loaded with the cache that saw the one before (which re-checks only the
    folders the commit touched, when no name or job reference changed) gives what a load
    of that commit from nothing gives: every manifest problem, names and order included."""
    from ..gitserver import WorkRepo

    work = WorkRepo(tmp_path / "work")
    uses_job = ("    env:", "      DSN: {job: migrate}")
    has_job = ("    jobs:", "      - name: migrate", "        runId: 1")
    steps: list[dict[str, str | bytes | None]] = [
        {
            **{f"{n}/sless.yaml": manifest_text(name=n) for n in "ace"},
            **{f"{n}/handler.py": HANDLER for n in "abce"},
            "b/sless.yaml": manifest_text(*uses_job, name="b"),
            "c/sless.yaml": manifest_text(*has_job, name="c"),
            "p/sless.yaml": manifest_text(name="p"),
            "p/handler.py": HANDLER,
            "p/q/sless.yaml": manifest_text(name="q"),
            "p/q/handler.py": HANDLER,
        },
        {"a/handler.py": HANDLER + "# v2\n"},  # code only
        {"b/sless.yaml": manifest_text(*uses_job, "    memoryMB: 1", name="b")},  # invalid
        {"b/handler.py": HANDLER + "# v2\n"},  # still invalid, the same names
        {"b/sless.yaml": manifest_text(*uses_job, "    memoryMB: 1", name="b") + "# x\n"},
        {"b/sless.yaml": manifest_text(*uses_job, name="b")},  # fixed
        {"a/sless.yaml": "functions: [\n"},  # unreadable: declares no names now
        {"a/sless.yaml": manifest_text(name="a")},
        {"d/sless.yaml": manifest_text(name="a"), "d/handler.py": HANDLER},  # a name twice
        {"c/handler.py": HANDLER + "# v2\n"},  # while a problem spans files
        {"d/sless.yaml": None, "d/handler.py": None},  # it heals
        {"c/sless.yaml": manifest_text("    jobs:", "      - name: other", name="c")},
        {"c/sless.yaml": manifest_text(*has_job, name="c")},
        {"p/q/handler.py": HANDLER + "# v2\n"},  # below two manifests
        {"e/sless.yaml": manifest_text(name="e2")},  # a rename
        {"README.md": "a file outside every function\n"},
        {"a/handler.py": None, "a/sless.yaml": None},  # a folder removed
        {"a/sless.yaml": manifest_text(name="a"), "a/handler.py": HANDLER},  # and back
        {"e/data.bin": b"\x00binary\n", "e/lib/util.py": "X = 1\n"},
    ]
    cache = manifest.ManifestCache()
    for number, files in enumerate(steps):
        work.commit(f"step {number}", files)
        snapshot = open_snapshot(work.path)
        cached = manifest.load(snapshot, cache)
        fresh = manifest.load(open_snapshot(work.path))
        assert _answers(cached) == _answers(fresh), f"step {number}: {files}"
        assert cached.revision == snapshot.revision
    assert sorted(cached.functions) == ["a", "b", "c", "e2", "p", "q"], cached.problems


def test_every_problem_of_a_file_is_reported_at_once(write_repo) -> None:
    """A bad name does not hide a bad schedule or a missing handler file, in the same
    function or the next one: one run of validate lists them all."""
    root = write_repo(
        {
            "fn/sless.yaml": (
                "functions:\n"
                "  - name: New_Fn\n"
                "    runtime: python3.11\n"
                "    entrypoint: missing.main\n"
                "    triggers:\n"
                "      - {type: cron, schedule: '61 * * * *'}\n"
                "  - name: second\n"
                "    runtime: python3.11\n"
                "    entrypoint: handler.main\n"
                "    memoryMB: 1\n"
                "    triggers:\n"
                "      - {type: cron, schedule: '* * 32 * *'}\n"
            ),
            "fn/handler.py": HANDLER,
        }
    )
    assert problem_lines(load_dir(root)) == [
        'fn/sless.yaml:2: functions[0].name: "New_Fn" must be a DNS-1123 label: lowercase '
        "letters, digits and '-', starting with a letter and ending with a letter or digit",
        "fn/sless.yaml:4: functions[0].entrypoint: fn/missing.py does not exist (runtime "
        "python3.11)",
        "fn/sless.yaml:6: functions[0].triggers[0].schedule: minute field: 61 is out of range "
        "0..59",
        "fn/sless.yaml:10: functions[1].memoryMB: 1 is less than the minimum of 64",
        "fn/sless.yaml:12: functions[1].triggers[0].schedule: day-of-month field: 32 is out of "
        "range 1..31",
    ]
