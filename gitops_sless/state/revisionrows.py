"""The status store's rows of revisions, pins and rollouts (see ``revisions`` and
``steps.revisions``): a part of :class:`~.store.Store`, kept apart to keep each module to
one subject."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["ROLLOUT_PHASES", "RevisionRows"]

# Withdrawn: stopped without a verdict (a revert, a rollback by hand, its revision gone):
# unlike RolledBack, the same version may be rolled out again
ROLLOUT_PHASES = ("Progressing", "Promoted", "RolledBack", "Withdrawn")


class RevisionRows:
    """Methods of :class:`~.store.Store` (which supplies ``_tx``, ``_all`` and ``_lock``)."""

    _lock: threading.RLock

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _all(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def add_revision(
        self,
        env: str,
        name: str,
        spec_hash: str,
        deployment: dict[str, Any],
        commit: str | None,
        image: str | None = None,
    ) -> dict[str, Any]:
        """The revision of ``name`` that ``spec_hash`` is: numbered next if it is new,
        else the one it was (deployed again: its ``deployed`` time moves)."""
        now = time.time()
        with self._tx() as db:
            row = db.execute(
                "SELECT * FROM revisions WHERE env = ? AND name = ? AND spec_hash = ?",
                (env, name, spec_hash),
            ).fetchone()
            if row is not None:
                db.execute(
                    "UPDATE revisions SET deployed = ? WHERE env = ? AND name = ? AND number = ?",
                    (now, env, name, row["number"]),
                )
                return {**row, "deployed": now}
            given = db.execute(
                "SELECT MAX(n) AS n FROM (SELECT MAX(number) AS n FROM revisions"
                " WHERE env = ? AND name = ? UNION ALL SELECT last FROM revision_numbers"
                " WHERE env = ? AND name = ?)",
                (env, name, env, name),
            ).fetchone()
            number = (given["n"] or 0) + 1
            db.execute(
                "INSERT OR REPLACE INTO revision_numbers (env, name, last) VALUES (?, ?, ?)",
                (env, name, number),
            )
            fields = {
                "env": env,
                "name": name,
                "number": number,
                "spec_hash": spec_hash,
                "deployment": json.dumps(deployment, sort_keys=True),
                "commit_sha": commit,
                "build_tag": deployment["function"]["buildTag"],
                "image": image,
                "created": now,
                "deployed": now,
            }
            marks = ", ".join("?" * len(fields))
            db.execute(
                f"INSERT INTO revisions ({', '.join(fields)}) VALUES ({marks})",
                tuple(fields.values()),
            )
            return fields

    def revisions(self, env: str, name: str | None = None) -> list[dict[str, Any]]:
        """The revisions of ``name`` (None: of every function of ``env``), newest first."""
        if name is None:
            return self._all(
                "SELECT * FROM revisions WHERE env = ? ORDER BY name, number DESC", env
            )
        return self._all(
            "SELECT * FROM revisions WHERE env = ? AND name = ? ORDER BY number DESC", env, name
        )

    def drop_revisions(self, env: str, name: str, numbers: Iterable[int]) -> None:
        with self._tx() as db:
            db.executemany(
                "DELETE FROM revisions WHERE env = ? AND name = ? AND number = ?",
                [(env, name, n) for n in numbers],
            )

    def pin(self, env: str, name: str, number: int, desired: str | None, by: str) -> None:
        """Hold ``name`` at revision ``number`` while its desired spec hash is ``desired``."""
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO pins (env, name, number, desired, by, at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (env, name, number, desired, by, time.time()),
            )

    def unpin(self, env: str, name: str) -> dict[str, Any] | None:
        """Forget the pin of ``name``; the pin it had, if any."""
        with self._tx() as db:
            row = db.execute(
                "SELECT * FROM pins WHERE env = ? AND name = ?", (env, name)
            ).fetchone()
            db.execute("DELETE FROM pins WHERE env = ? AND name = ?", (env, name))
            return row

    def pins(self, env: str) -> dict[str, dict[str, Any]]:
        return {row["name"]: row for row in self._all("SELECT * FROM pins WHERE env = ?", env)}

    def pin_of(self, env: str, name: str) -> dict[str, Any] | None:
        rows = self._all("SELECT * FROM pins WHERE env = ? AND name = ?", env, name)
        return rows[0] if rows else None

    # --- rollouts --------------------------------------------------------------------------

    def set_rollout(self, env: str, name: str, **fields: Any) -> None:
        """Create or update ``name``'s rollout (one per function: the latest)."""
        if "phase" in fields and fields["phase"] not in ROLLOUT_PHASES:
            raise ValueError(f"unknown rollout phase {fields['phase']!r}")
        unknown = set(fields) - set(_ROLLOUT_FIELDS)
        if unknown:
            raise ValueError(f"unknown rollout fields: {sorted(unknown)}")
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO rollouts (env, name, candidate, stable, phase, updated)"
                " VALUES (?, ?, '', '', 'Progressing', ?)",
                (env, name, time.time()),
            )
            sets = ", ".join(f"{key} = ?" for key in fields)
            db.execute(
                f"UPDATE rollouts SET {sets}, updated = ? WHERE env = ? AND name = ?",
                (*fields.values(), time.time(), env, name),
            )

    def rollouts(self, env: str) -> dict[str, dict[str, Any]]:
        return {row["name"]: row for row in self._all("SELECT * FROM rollouts WHERE env = ?", env)}

    def rollout_of(self, env: str, name: str) -> dict[str, Any] | None:
        rows = self._all("SELECT * FROM rollouts WHERE env = ? AND name = ?", env, name)
        return rows[0] if rows else None


_ROLLOUT_FIELDS = ("candidate", "stable", "phase", "step", "step_started", "message")
