"""The status store: what the reconciler did and what it sees, in SQLite (WAL mode).

It survives restarts, so it is also the memory that keeps work from being
done twice: a build tag recorded as ``Succeeded`` is never built again, a job
run recorded as finished is never run again. Rows are plain dicts.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["FUNCTION_PHASES", "JOB_PHASES", "Store"]

FUNCTION_PHASES = ("Pending", "Building", "Ready", "Failed", "Invalid", "Disabled")
JOB_PHASES = ("Pending", "Running", "Succeeded", "Failed", "Skipped")
BUILD_PHASES = ("Building", "Succeeded", "Failed")
MAX_INVOCATIONS = 5000
MAX_SYNCS = 1000
LOG_TAIL_CHARS = 4000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS syncs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    env TEXT NOT NULL,
    trigger TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    revision TEXT,
    result TEXT NOT NULL,
    error TEXT
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
    PRIMARY KEY (env, name)
);
CREATE TABLE IF NOT EXISTS builds (
    tag TEXT PRIMARY KEY,
    runtime TEXT NOT NULL,
    source_id TEXT NOT NULL,
    phase TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    log TEXT NOT NULL DEFAULT '',
    error TEXT
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
    request_id TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS invocations_by_function ON invocations (env, name, id);
"""

_FUNCTION_FIELDS = ("phase", "build_tag", "revision", "url", "message", "manifest", "spec")
_JOB_FIELDS = ("function", "phase", "result", "error", "started", "finished")


def _row(cursor: sqlite3.Cursor, values: tuple[Any, ...]) -> dict[str, Any]:
    row = {col[0]: value for col, value in zip(cursor.description, values, strict=True)}
    if isinstance(row.get("spec"), str):
        row["spec"] = json.loads(row["spec"])
    return row


class Store:
    """One SQLite database; safe to share between threads (one connection, one lock)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = _row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _all(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, *args: Any) -> dict[str, Any] | None:
        rows = self._all(sql, *args)
        return rows[0] if rows else None

    # --- syncs ---------------------------------------------------------------------

    def begin_sync(self, env: str, trigger: str) -> int:
        with self._tx() as db:
            cursor = db.execute(
                "INSERT INTO syncs (env, trigger, started, result) VALUES (?, ?, ?, 'Running')",
                (env, trigger, time.time()),
            )
            db.execute(
                "DELETE FROM syncs WHERE id <= (SELECT MAX(id) FROM syncs) - ?", (MAX_SYNCS,)
            )
            return int(cursor.lastrowid or 0)

    def finish_sync(
        self, sync_id: int, result: str, revision: str | None = None, error: str | None = None
    ) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE syncs SET finished = ?, result = ?, revision = COALESCE(?, revision),"
                " error = ? WHERE id = ?",
                (time.time(), result, revision, error, sync_id),
            )

    def syncs(self, limit: int = 50, env: str | None = None) -> list[dict[str, Any]]:
        if env is None:
            return self._all("SELECT * FROM syncs ORDER BY id DESC LIMIT ?", limit)
        return self._all("SELECT * FROM syncs WHERE env = ? ORDER BY id DESC LIMIT ?", env, limit)

    def last_sync(self, env: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM syncs WHERE env = ? ORDER BY id DESC LIMIT 1", env)

    # --- functions -------------------------------------------------------------------

    def set_function(self, env: str, name: str, **fields: Any) -> None:
        """Create or update one function's record; fields not given keep their value."""
        unknown = set(fields) - set(_FUNCTION_FIELDS)
        if unknown:
            raise ValueError(f"unknown function fields: {sorted(unknown)}")
        if "phase" in fields and fields["phase"] not in FUNCTION_PHASES:
            raise ValueError(f"unknown phase {fields['phase']!r}")
        if "spec" in fields:
            fields["spec"] = json.dumps(fields["spec"], sort_keys=True)
        with self._tx() as db:
            exists = db.execute(
                "SELECT 1 FROM functions WHERE env = ? AND name = ?", (env, name)
            ).fetchall()
            if not exists:
                db.execute(
                    "INSERT INTO functions (env, name, phase, updated) VALUES (?, ?, 'Pending', ?)",
                    (env, name, time.time()),
                )
            if fields:
                assignments = ", ".join(f"{key} = ?" for key in fields)
                db.execute(
                    f"UPDATE functions SET {assignments}, updated = ? WHERE env = ? AND name = ?",
                    (*fields.values(), time.time(), env, name),
                )

    def function(self, env: str, name: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM functions WHERE env = ? AND name = ?", env, name)

    def functions(self, env: str) -> list[dict[str, Any]]:
        return self._all("SELECT * FROM functions WHERE env = ? ORDER BY name", env)

    def delete_function(self, env: str, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM functions WHERE env = ? AND name = ?", (env, name))

    def environments(self) -> list[str]:
        rows = self._all(
            "SELECT env FROM functions UNION SELECT env FROM syncs UNION SELECT env FROM jobs"
        )
        return sorted(row["env"] for row in rows)

    # --- builds ------------------------------------------------------------------------

    def build(self, tag: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM builds WHERE tag = ?", tag)

    def start_build(self, tag: str, runtime: str, source_id: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO builds (tag, runtime, source_id, phase, started) "
                "VALUES (?, ?, ?, 'Building', ?) ON CONFLICT (tag) DO UPDATE SET "
                "phase = 'Building', started = excluded.started, finished = NULL, error = NULL",
                (tag, runtime, source_id, time.time()),
            )

    def finish_build(self, tag: str, phase: str, log: str, error: str | None = None) -> None:
        if phase not in BUILD_PHASES:
            raise ValueError(f"unknown build phase {phase!r}")
        with self._tx() as db:
            db.execute(
                "UPDATE builds SET phase = ?, finished = ?, log = ?, error = ? WHERE tag = ?",
                (phase, time.time(), log[-LOG_TAIL_CHARS * 4 :], error, tag),
            )

    def builds(self, limit: int = 100) -> list[dict[str, Any]]:
        return self._all("SELECT * FROM builds ORDER BY started DESC LIMIT ?", limit)

    # --- jobs -----------------------------------------------------------------------------

    def job_run(self, env: str, name: str, run_id: int) -> dict[str, Any] | None:
        return self._one(
            "SELECT * FROM jobs WHERE env = ? AND name = ? AND run_id = ?", env, name, run_id
        )

    def set_job_run(self, env: str, name: str, run_id: int, **fields: Any) -> None:
        unknown = set(fields) - set(_JOB_FIELDS)
        if unknown:
            raise ValueError(f"unknown job fields: {sorted(unknown)}")
        if "phase" in fields and fields["phase"] not in JOB_PHASES:
            raise ValueError(f"unknown job phase {fields['phase']!r}")
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs (env, name, run_id, function, phase) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (env, name, run_id) DO NOTHING",
                (env, name, run_id, fields.get("function", ""), fields.get("phase", "Pending")),
            )
            if fields:
                assignments = ", ".join(f"{key} = ?" for key in fields)
                db.execute(
                    f"UPDATE jobs SET {assignments} WHERE env = ? AND name = ? AND run_id = ?",
                    (*fields.values(), env, name, run_id),
                )

    def jobs(self, env: str, name: str | None = None) -> list[dict[str, Any]]:
        if name is None:
            return self._all("SELECT * FROM jobs WHERE env = ? ORDER BY name, run_id DESC", env)
        return self._all(
            "SELECT * FROM jobs WHERE env = ? AND name = ? ORDER BY run_id DESC", env, name
        )

    def latest_success(self, env: str, name: str) -> dict[str, Any] | None:
        """The newest succeeded run of a job: its result is what dependents receive."""
        return self._one(
            "SELECT * FROM jobs WHERE env = ? AND name = ? AND phase = 'Succeeded' "
            "ORDER BY run_id DESC LIMIT 1",
            env,
            name,
        )

    # --- invocations ------------------------------------------------------------------------

    def record_invocations(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Rows of (env, name, method, path, status, duration_ms, time, request_id)."""
        rows = list(rows)
        if not rows:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO invocations (env, name, method, path, status, duration_ms, time,"
                " request_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            db.execute(
                "DELETE FROM invocations WHERE id <= (SELECT MAX(id) FROM invocations) - ?",
                (MAX_INVOCATIONS,),
            )

    def invocations(self, env: str, name: str, limit: int = 20) -> list[dict[str, Any]]:
        return self._all(
            "SELECT * FROM invocations WHERE env = ? AND name = ? ORDER BY id DESC LIMIT ?",
            env,
            name,
            limit,
        )
