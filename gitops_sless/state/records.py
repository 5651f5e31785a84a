"""One environment's function records, read from the status store once and written through.

A pass compares every function's derived fields with its record; reading
10,000 rows from SQLite on every poll would cost more than the rest of the
pass. The reconciler of an environment is the only writer of its rows, so
the copy here stays true; :meth:`reload` reads them again when that may not
hold (a replica that followed another leader).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from .store import Store

__all__ = ["Records"]


class Records:
    def __init__(self, store: Store, env: str) -> None:
        self.store = store
        self.env = env
        self._lock = threading.Lock()
        self._rows: dict[str, dict[str, Any]] = {}
        self._unsettled: set[str] = set()  # names whose phase is neither Ready nor Disabled
        self.version = 0  # moves on every write: whoever shows the records looks again
        self.reload()

    def reload(self) -> None:
        rows = {row["name"]: row for row in self.store.functions(self.env)}
        with self._lock:
            self._rows = rows
            self._unsettled = {name for name, row in rows.items() if not _settled(row)}
            self.version += 1

    def names(self) -> list[str]:
        with self._lock:
            return list(self._rows)

    def all(self) -> list[dict[str, Any]]:
        """Every record, ordered by name, as the store would return them."""
        with self._lock:
            return [dict(self._rows[name]) for name in sorted(self._rows)]

    def unsettled(self) -> dict[str, dict[str, Any]]:
        """Records of functions that are not Ready or Disabled, by name (a pass's result
        depends on these only; there are few: they are kept apart on every write)."""
        with self._lock:
            return {name: dict(self._rows[name]) for name in sorted(self._unsettled)}

    def update(self, name: str, **fields: Any) -> bool:
        """Write the fields that differ from the record (creating it); True if any did."""
        return self.update_many({name: fields}) == 1

    def update_many(self, fields: Mapping[str, Mapping[str, Any]]) -> int:
        """:meth:`update` for each name, in one store transaction; how many changed."""
        with self._lock:
            changes: dict[str, Mapping[str, Any]] = {}
            for name, given in fields.items():
                row = self._rows.get(name)
                changed = (
                    given if row is None else {k: v for k, v in given.items() if row.get(k) != v}
                )
                if row is None or changed:
                    changes[name] = changed
            if not changes:
                return 0
            self.store.set_functions(self.env, changes)
            for fresh in self.store.functions(self.env, changes):
                name = fresh["name"]
                self._rows[name] = fresh
                if _settled(fresh):
                    self._unsettled.discard(name)
                else:
                    self._unsettled.add(name)
            self.version += 1
            return len(changes)

    def delete(self, name: str) -> None:
        with self._lock:
            self.store.delete_function(self.env, name)
            self._rows.pop(name, None)
            self._unsettled.discard(name)
            self.version += 1


def _settled(row: dict[str, Any]) -> bool:
    return row["phase"] in ("Ready", "Idle", "Disabled")
