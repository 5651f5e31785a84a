"""The status store's tables, and how a database from an earlier release is brought up to
date: columns added since, and builds keyed by tag and trust scope."""

from __future__ import annotations

import sqlite3

from .notifyrows import NOTIFY_TABLE

__all__ = ["create_or_upgrade"]

TABLES = """
CREATE TABLE IF NOT EXISTS syncs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env TEXT NOT NULL,
    trigger TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    revision TEXT,
    result TEXT NOT NULL,
    error TEXT,
    count INTEGER NOT NULL DEFAULT 1,
    last_seen REAL
);
CREATE TABLE IF NOT EXISTS functions (
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    phase TEXT NOT NULL,
    build_tag TEXT,
    revision TEXT,
    url TEXT,
    message TEXT,
    manifest TEXT,
    spec TEXT,
    updated REAL NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0,
    last_exit TEXT,
    PRIMARY KEY (env, name)
);
-- what each function serves: the deployment as it was started, so a restart starts
-- exactly it, whatever the repository says now (see state/serving.py)
CREATE TABLE IF NOT EXISTS serving (
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    deployment TEXT NOT NULL,
    revision TEXT,
    deployed REAL NOT NULL,
    PRIMARY KEY (env, name)
);
-- every distinct version of a function deployed in an environment (see state/revisions.py):
-- numbered per function (r1, r2, ...), with the deployment to start it again
CREATE TABLE IF NOT EXISTS revisions (
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    number INTEGER NOT NULL,
    spec_hash TEXT NOT NULL,
    deployment TEXT NOT NULL,
    commit_sha TEXT,
    build_tag TEXT NOT NULL,
    image TEXT,
    created REAL NOT NULL,
    deployed REAL NOT NULL,
    PRIMARY KEY (env, name, number)
);
CREATE UNIQUE INDEX IF NOT EXISTS revisions_by_hash ON revisions (env, name, spec_hash);
-- the last number given to a revision of each function: a number is never given twice,
-- even once the revision that had it is collected (pins and URLs name it)
CREATE TABLE IF NOT EXISTS revision_numbers (
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    last INTEGER NOT NULL,
    PRIMARY KEY (env, name)
);
-- a function held at an earlier revision on purpose (a rollback) until a commit changes it
-- (its desired spec hash is no longer ``desired``) or someone unpins it
CREATE TABLE IF NOT EXISTS pins (
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    number INTEGER NOT NULL,
    desired TEXT,
    by TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (env, name)
);
-- the latest rollout of each function (steps/rollouts.py): the candidate's and the stable
-- revision's spec hashes, the step it is at and since when, and how it went
CREATE TABLE IF NOT EXISTS rollouts (
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    candidate TEXT NOT NULL,
    stable TEXT NOT NULL,
    phase TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    step_started REAL,
    message TEXT,
    updated REAL NOT NULL,
    PRIMARY KEY (env, name)
);
CREATE TABLE IF NOT EXISTS jobs (
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    run_id INTEGER NOT NULL,
    function TEXT NOT NULL,
    phase TEXT NOT NULL,
    result TEXT,
    error TEXT,
    started REAL,
    finished REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (env, name, run_id)
);
CREATE TABLE IF NOT EXISTS invocations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env TEXT NOT NULL,
    name TEXT NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    status INTEGER NOT NULL,
    duration_ms REAL NOT NULL,
    time REAL NOT NULL,
    request_id TEXT NOT NULL,
    truncated INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS invocations_by_function ON invocations (env, name, id);
CREATE TABLE IF NOT EXISTS previews (
    number INTEGER PRIMARY KEY,
    head TEXT,
    title TEXT,
    author TEXT,
    base TEXT,
    head_branch TEXT,
    labels TEXT NOT NULL DEFAULT '[]',
    forge_open INTEGER,
    state TEXT NOT NULL,
    reason TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    head_since REAL,
    reported TEXT
);
-- webhook deliveries already acted on (see claim_delivery): an id the forge sent, and for
-- pull-request events the body's digest (the signature covers the body, not the id)
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    forge TEXT NOT NULL,
    delivery TEXT,
    digest TEXT,
    received REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_id ON webhook_deliveries (forge, delivery);
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_digest ON webhook_deliveries (forge, digest);
CREATE INDEX IF NOT EXISTS webhook_deliveries_by_time ON webhook_deliveries (received);
"""

# one row per build tag and trust scope (Backend.build_scope: "" trusted, "untrusted" a
# fork's): a failed build in one scope never holds back the same tag in another
BUILDS_TABLE = """
CREATE TABLE IF NOT EXISTS builds (
    tag TEXT NOT NULL,
    scope TEXT NOT NULL DEFAULT '',
    runtime TEXT NOT NULL,
    source_id TEXT NOT NULL,
    phase TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    log TEXT NOT NULL DEFAULT '',
    error TEXT,
    folder TEXT NOT NULL DEFAULT '',
    image TEXT,
    PRIMARY KEY (tag, scope)
);
"""


# columns added after the first release: (table, column, definition) for older databases
_ADDED_COLUMNS = (
    ("syncs", "count", "INTEGER NOT NULL DEFAULT 1"),
    ("functions", "restarts", "INTEGER NOT NULL DEFAULT 0"),
    ("functions", "last_exit", "TEXT"),
    ("syncs", "last_seen", "REAL"),
    ("builds", "folder", "TEXT NOT NULL DEFAULT ''"),
    ("jobs", "attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("invocations", "truncated", "INTEGER NOT NULL DEFAULT 0"),
    ("functions", "next_retry", "REAL"),
    ("functions", "wanted_tag", "TEXT"),
    # who may run a preview (previews/trust.py): the PR's origin (1 same repository, 0 fork, NULL
    # unknown), the commit the filter's label was added at, the approved commit and by whom,
    # and a label awaiting the forge's word on its author ({"user", "id", "sha"} as JSON)
    ("previews", "same_repo", "INTEGER"),
    ("previews", "label_sha", "TEXT"),
    ("previews", "approved", "TEXT"),
    ("previews", "approved_by", "TEXT"),
    ("previews", "approval_request", "TEXT"),
    ("builds", "image", "TEXT"),  # what a build made, named immutably (image@sha256:...)
    # the revision serving (r3), and the one a rollback pins it at (state/revisions.py)
    ("functions", "serving_revision", "TEXT"),
    ("functions", "pinned", "TEXT"),
    # a call's trace when it is not its request id's, and how long it waited for a start
    ("invocations", "trace_id", "TEXT NOT NULL DEFAULT ''"),
    ("invocations", "cold_ms", "REAL"),
    ("invocations", "bytes", "INTEGER"),
    ("invocations", "chunks", "INTEGER"),
)

# the columns of a build row before trust scopes (all of them, _ADDED_COLUMNS included)
_BUILD_COLUMNS = (
    "tag",
    "runtime",
    "source_id",
    "phase",
    "started",
    "finished",
    "log",
    "error",
    "folder",
    "image",
)


def create_or_upgrade(db: sqlite3.Connection) -> None:
    """Every table, as this release writes them, in ``db`` (autocommit mode)."""
    db.executescript(TABLES + BUILDS_TABLE + NOTIFY_TABLE)
    for table, column, definition in _ADDED_COLUMNS:
        if column not in _columns(db, table):
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
    _scope_builds(db)


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    # from the cursor's description: whatever row factory the connection has
    return {column[0] for column in db.execute(f"SELECT * FROM {table} LIMIT 0").description}


def _scope_builds(db: sqlite3.Connection) -> None:
    """A database from before trust scopes keyed builds by tag alone: its rows are
    kept, each as the trusted scope's (the only scope that then had builds of its own
    on the local backend; a fork's failed build there ages out after build_retry_sec)."""
    if "scope" in _columns(db, "builds"):
        return
    kept = ", ".join(_BUILD_COLUMNS)
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("ALTER TABLE builds RENAME TO builds_by_tag")
        db.execute(BUILDS_TABLE)
        db.execute(f"INSERT INTO builds ({kept}) SELECT {kept} FROM builds_by_tag")
        db.execute("DROP TABLE builds_by_tag")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
