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
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import schema
from .notifyrows import NotifyRows
from .revisionrows import RevisionRows

__all__ = ["BUILD_PHASES", "FUNCTION_PHASES", "JOB_PHASES", "Store"]

FUNCTION_PHASES = (
    "Pending",
    "Building",
    "Ready",
    "Idle",
    "Progressing",
    "RolledBack",
    "Failed",
    "Invalid",
    "Disabled",
)
JOB_PHASES = ("Pending", "Running", "Succeeded", "Failed", "Skipped")
BUILD_PHASES = ("Building", "Succeeded", "Failed")
MAX_INVOCATIONS_PER_FUNCTION = 500  # per function: a flood on one never evicts another's
MAX_SYNCS = 1000
LOG_TAIL_CHARS = 4000
MAX_STORED_PATH = 256  # bytes of an invocation's path and query kept; the rest is cut
MAX_DELIVERIES = 10_000  # webhook deliveries remembered, and for at most DELIVERY_MAX_AGE_SEC
DELIVERY_MAX_AGE_SEC = 7 * 86400


def _preview(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "labels": json.loads(row["labels"] or "[]")}


_FUNCTION_FIELDS = (
    "phase",
    "build_tag",
    "revision",
    "url",
    "message",
    "manifest",
    "spec",
    "restarts",
    "last_exit",
    "next_retry",
    "wanted_tag",
    "serving_revision",
    "pinned",
)
# host parameters per query: SQLite before 3.32 allows at most 999
_PARAMS_PER_QUERY = 900
_ENVIRONMENT_TABLES = (
    "functions",
    "serving",
    "jobs",
    "syncs",
    "invocations",
    "revisions",
    "revision_numbers",
    "pins",
    "rollouts",
)
_JOB_FIELDS = ("function", "phase", "result", "error", "started", "finished", "attempts")


def _row(cursor: sqlite3.Cursor, values: tuple[Any, ...]) -> dict[str, Any]:
    row = {col[0]: value for col, value in zip(cursor.description, values, strict=True)}
    if isinstance(row.get("spec"), str):
        row["spec"] = json.loads(row["spec"])
    return row


class Store(RevisionRows, NotifyRows):
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
        with self._lock:
            schema.create_or_upgrade(self._db)

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

    def begin_sync(self, env: str, trigger: str, started: float | None = None) -> int:
        with self._tx() as db:
            cursor = db.execute(
                "INSERT INTO syncs (env, trigger, started, result) VALUES (?, ?, ?, 'Running')",
                (env, trigger, started or time.time()),
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

    def repeat_sync(
        self,
        env: str,
        trigger: str,
        started: float,
        result: str,
        revision: str | None,
        error: str | None,
    ) -> int:
        """Record a pass that changed nothing: the previous row counts it if it says the same.

        So polls that find nothing new never push the pass that mattered out of
        the history; a pass whose outcome differs gets a row of its own.
        """
        last = self.last_sync(env)
        same = last and (last["result"], last["revision"], last["error"]) == (
            result,
            revision,
            error,
        )
        if not same:
            sync_id = self.begin_sync(env, trigger, started)
            self.finish_sync(sync_id, result, revision, error)
            return sync_id
        with self._tx() as db:
            db.execute(
                "UPDATE syncs SET count = count + 1, last_seen = ? WHERE id = ?",
                (time.time(), last["id"]),
            )
        return int(last["id"])

    def syncs(self, limit: int = 50, env: str | None = None) -> list[dict[str, Any]]:
        if env is None:
            return self._all("SELECT * FROM syncs ORDER BY id DESC LIMIT ?", limit)
        return self._all("SELECT * FROM syncs WHERE env = ? ORDER BY id DESC LIMIT ?", env, limit)

    def last_sync(self, env: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM syncs WHERE env = ? ORDER BY id DESC LIMIT 1", env)

    # --- functions -------------------------------------------------------------------

    def set_function(
        self, env: str, name: str, *, updated: float | None = None, **fields: Any
    ) -> None:
        """Create or update one function's record; fields not given keep their value.

        ``updated`` is now, unless given (a record copied from another replica's).
        """
        self.set_functions(env, {name: fields}, updated=updated)

    def set_functions(
        self, env: str, changes: Mapping[str, Mapping[str, Any]], *, updated: float | None = None
    ) -> None:
        """:meth:`set_function` for each name of ``changes``, in one transaction: a pass
        that writes every record of a large environment commits once, not per record."""
        stamp = time.time() if updated is None else updated
        rows = {name: _function_fields(fields) for name, fields in changes.items()}
        with self._tx() as db:
            for name, fields in rows.items():
                db.execute(
                    "INSERT OR IGNORE INTO functions (env, name, phase, updated)"
                    " VALUES (?, ?, 'Pending', ?)",
                    (env, name, stamp),
                )
                if fields:
                    assignments = ", ".join(f"{key} = ?" for key in fields)
                    db.execute(
                        f"UPDATE functions SET {assignments}, updated = ? "
                        "WHERE env = ? AND name = ?",
                        (*fields.values(), stamp, env, name),
                    )

    def function(self, env: str, name: str) -> dict[str, Any] | None:
        return self._one("SELECT * FROM functions WHERE env = ? AND name = ?", env, name)

    def functions(self, env: str, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every record of ``env``, or those of ``names``, ordered by name."""
        if names is None:
            return self._all("SELECT * FROM functions WHERE env = ? ORDER BY name", env)
        wanted = sorted(set(names))
        rows: list[dict[str, Any]] = []
        for start in range(0, len(wanted), _PARAMS_PER_QUERY):
            chunk = wanted[start : start + _PARAMS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            rows += self._all(
                f"SELECT * FROM functions WHERE env = ? AND name IN ({marks})", env, *chunk
            )
        return sorted(rows, key=lambda row: row["name"])

    def delete_function(self, env: str, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM functions WHERE env = ? AND name = ?", (env, name))
            for table in (
                "serving",
                "invocations",
                "revisions",
                "revision_numbers",
                "pins",
                "rollouts",
            ):
                db.execute(f"DELETE FROM {table} WHERE env = ? AND name = ?", (env, name))

    # --- what serves ------------------------------------------------------------------

    def set_serving(
        self, env: str, name: str, deployment: dict[str, Any], revision: str | None
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO serving (env, name, deployment, revision, deployed)"
                " VALUES (?, ?, ?, ?, ?)",
                (env, name, json.dumps(deployment, sort_keys=True), revision, time.time()),
            )

    def serving(self, env: str) -> list[dict[str, Any]]:
        """What each function of ``env`` was last deployed as (``deployment`` decoded)."""
        rows = self._all("SELECT * FROM serving WHERE env = ? ORDER BY name", env)
        return [{**row, "deployment": json.loads(row["deployment"])} for row in rows]

    def delete_environment(self, env: str) -> None:
        """Every row of ``env``: functions, what serves, job runs, sync history, invocations."""
        with self._tx() as db:
            for table in _ENVIRONMENT_TABLES:
                db.execute(f"DELETE FROM {table} WHERE env = ?", (env,))

    # --- previews ------------------------------------------------------------------------

    def preview(self, number: int) -> dict[str, Any] | None:
        row = self._one("SELECT * FROM previews WHERE number = ?", number)
        return _preview(row) if row else None

    def previews(self) -> list[dict[str, Any]]:
        return [_preview(row) for row in self._all("SELECT * FROM previews ORDER BY number")]

    def set_preview(self, number: int, **fields: Any) -> None:
        """Create or update what is known of pull request ``number``."""
        if "labels" in fields:
            fields["labels"] = json.dumps(list(fields["labels"]))
        now = time.time()
        with self._tx() as db:
            db.execute(
                "INSERT INTO previews (number, state, created, updated) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (number) DO NOTHING",
                (number, fields.get("state", "Waiting"), now, now),
            )
            if fields:
                assignments = ", ".join(f"{key} = ?" for key in fields)
                db.execute(
                    f"UPDATE previews SET {assignments}, updated = ? WHERE number = ?",
                    (*fields.values(), now, number),
                )

    def delete_preview(self, number: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM previews WHERE number = ?", (number,))

    def environments(self) -> list[str]:
        rows = self._all(
            "SELECT env FROM functions UNION SELECT env FROM syncs UNION SELECT env FROM jobs"
        )
        return sorted(row["env"] for row in rows)

    # --- webhook deliveries ----------------------------------------------------------------

    def claim_delivery(
        self,
        forge: str,
        delivery: str | None,
        digest: str | None,
        *,
        now: float | None = None,
        keep: int = MAX_DELIVERIES,
        max_age: float = DELIVERY_MAX_AGE_SEC,
    ) -> bool:
        """Record a webhook delivery; False when its id or its digest was recorded already.

        Check and record are one transaction, so of two identical deliveries at
        once exactly one is claimed. What is remembered is bounded: the newest
        ``keep`` deliveries of the last ``max_age`` seconds, pruned here.
        """
        if delivery is None and digest is None:
            return True  # nothing to know it by
        stamp = time.time() if now is None else now
        with self._tx() as db:
            oldest = stamp - max_age
            seen = db.execute(  # two lookups, one per index (an OR would scan the forge's rows)
                "SELECT 1 FROM webhook_deliveries WHERE forge = ? AND delivery = ?"
                " AND received >= ? UNION ALL"
                " SELECT 1 FROM webhook_deliveries WHERE forge = ? AND digest = ?"
                " AND received >= ? LIMIT 1",
                (forge, delivery, oldest, forge, digest, oldest),
            ).fetchall()
            if seen:
                return False
            db.execute(
                "INSERT INTO webhook_deliveries (forge, delivery, digest, received)"
                " VALUES (?, ?, ?, ?)",
                (forge, delivery, digest, stamp),
            )
            db.execute("DELETE FROM webhook_deliveries WHERE received < ?", (oldest,))
            # seq only grows: the newest ``keep`` are above this (fewer when some were released)
            db.execute(
                "DELETE FROM webhook_deliveries"
                " WHERE seq <= (SELECT MAX(seq) FROM webhook_deliveries) - ?",
                (keep,),
            )
            return True

    def release_delivery(self, forge: str, delivery: str | None, digest: str | None) -> None:
        """Forget a claimed delivery that could not be acted on: the forge may send it again."""
        with self._tx() as db:
            db.execute(
                "DELETE FROM webhook_deliveries WHERE forge = ? AND delivery IS ? AND digest IS ?",
                (forge, delivery, digest),
            )

    def deliveries(self) -> int:
        """How many webhook deliveries are remembered."""
        row = self._one("SELECT COUNT(*) AS count FROM webhook_deliveries")
        return int(row["count"]) if row else 0

    # --- builds ------------------------------------------------------------------------

    def build(self, tag: str, scope: str | None = None) -> dict[str, Any] | None:
        """The build of ``tag`` in trust ``scope`` (``Backend.build_scope``); None: the
        trusted scope's, else another's (what a reader of ``tag`` is shown)."""
        if scope is not None:
            return self._one("SELECT * FROM builds WHERE tag = ? AND scope = ?", tag, scope)
        return self._one(
            "SELECT * FROM builds WHERE tag = ? ORDER BY scope = '' DESC, started DESC LIMIT 1",
            tag,
        )

    def build_of(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """A function's build: of what the repository asks for (a failed one says why), else
        of what runs."""
        for tag in (record.get("wanted_tag"), record.get("build_tag")):
            build = self.build(tag) if tag else None
            if build is not None:
                return build
        return None

    def start_build(
        self, tag: str, runtime: str, source_id: str, folder: str = "", scope: str = ""
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO builds (tag, scope, runtime, source_id, phase, started, folder) "
                "VALUES (?, ?, ?, ?, 'Building', ?, ?) ON CONFLICT (tag, scope) DO UPDATE SET "
                "phase = 'Building', started = excluded.started, finished = NULL, error = NULL,"
                " image = NULL,"
                " folder = excluded.folder",
                (tag, scope, runtime, source_id, time.time(), folder),
            )

    def delete_builds(self, tags: Iterable[str], scope: str | None = None) -> None:
        """Forget the builds of ``tags`` in ``scope`` (None: in every scope)."""
        with self._tx() as db:
            if scope is None:
                db.executemany("DELETE FROM builds WHERE tag = ?", [(tag,) for tag in tags])
            else:
                db.executemany(
                    "DELETE FROM builds WHERE tag = ? AND scope = ?", [(t, scope) for t in tags]
                )

    def finish_build(
        self,
        tag: str,
        phase: str,
        log: str,
        error: str | None = None,
        image: str | None = None,
        scope: str = "",
    ) -> None:
        if phase not in BUILD_PHASES:
            raise ValueError(f"unknown build phase {phase!r}")
        with self._tx() as db:
            db.execute(
                "UPDATE builds SET phase = ?, finished = ?, log = ?, error = ?, image = ? "
                "WHERE tag = ? AND scope = ?",
                (phase, time.time(), log[-LOG_TAIL_CHARS * 4 :], error, image, tag, scope),
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
        """Rows of (env, name, method, path, status, duration_ms, time, request_id[,
        trace_id or "" when it is the request id, cold_ms or None when warm[, a stream's or
        a socket's bytes and a stream's chunks, else None]]).

        A path longer than MAX_STORED_PATH bytes is cut there and marked
        truncated; each function keeps its last MAX_INVOCATIONS_PER_FUNCTION calls.
        """
        stored = [_bounded_invocation(row) for row in rows]
        if not stored:
            return
        with self._tx() as db:
            db.executemany(
                "INSERT INTO invocations (env, name, method, path, status, duration_ms, time,"
                " request_id, trace_id, cold_ms, bytes, chunks, truncated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                stored,
            )
            for env, name in {(row[0], row[1]) for row in stored}:
                db.execute(
                    "DELETE FROM invocations WHERE env = ? AND name = ? AND id <= ("
                    "SELECT id FROM invocations WHERE env = ? AND name = ? "
                    "ORDER BY id DESC LIMIT 1 OFFSET ?)",
                    (env, name, env, name, MAX_INVOCATIONS_PER_FUNCTION),
                )

    def invocations(self, env: str, name: str, limit: int = 20) -> list[dict[str, Any]]:
        return self._all(
            "SELECT * FROM invocations WHERE env = ? AND name = ? ORDER BY id DESC LIMIT ?",
            env,
            name,
            limit,
        )


def _function_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` checked and as stored (``spec`` as JSON); ValueError names what is wrong."""
    unknown = set(fields) - set(_FUNCTION_FIELDS)
    if unknown:
        raise ValueError(f"unknown function fields: {sorted(unknown)}")
    if "phase" in fields and fields["phase"] not in FUNCTION_PHASES:
        raise ValueError(f"unknown phase {fields['phase']!r}")
    if "spec" in fields:
        return {**fields, "spec": json.dumps(fields["spec"], sort_keys=True)}
    return dict(fields)


def _cut(text: str, limit: int) -> tuple[str, bool]:
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) <= limit:
        return text, False
    return raw[:limit].decode("utf-8", "ignore"), True


def _bounded_invocation(row: tuple[Any, ...]) -> tuple[Any, ...]:
    env, name, method, path, status, duration_ms, at, request_id, *more = row
    # a row of before traces has neither trace_id nor cold_ms; of before streams, no sizes
    trace_id, cold_ms, size, chunks = (*more, *("", None, None, None)[len(more) :])[:4]
    path, cut = _cut(str(path), MAX_STORED_PATH)
    method, _ = _cut(str(method), 32)
    request_id, _ = _cut(str(request_id), 200)
    trace_id = str(trace_id)[:32]
    return (
        env,
        name,
        method,
        path,
        status,
        duration_ms,
        at,
        request_id,
        trace_id,
        cold_ms,
        size,
        chunks,
        int(cut),
    )
