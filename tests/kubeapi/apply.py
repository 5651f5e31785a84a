"""Server-side apply and field ownership (``managedFields``); patch formats: ``patches``.

Simplified but honest server-side apply, compared with the real structured-merge-diff:

* A field manager owns a set of *leaf paths*. Maps are walked into; every other value is a
  leaf. Lists are atomic leaves, except lists whose items are all objects with a string
  ``name`` (containers, env, ports, volumes, volumeMounts, ...), which merge by ``name``
  (the real server merges some of them by other keys, e.g. volumeMounts by mountPath and
  container ports by containerPort). A keyed item also has a ``.`` path for the item itself,
  as in real ``fieldsV1``.
* Conflicts are found on exact paths only: the applied config sets a leaf to a value that
  differs from the live one, and another manager (any other manager name, Apply or Update)
  owns that path. ``force=true`` moves the ownership instead. Managers are told apart by
  name only, so a manager's own Update entry never conflicts with its Apply.
* Fields the applier owned before and no longer sets are removed unless another manager
  owns them (or, for a list item, something inside it); maps left empty by that go too.
* Non-apply writes (create, update, merge/strategic/JSON patch) record an ``Update`` entry
  for their manager holding every leaf they changed (defaulted fields included, like the
  real server), and those leaves leave the other managers.
* ``status`` and server-owned metadata are never tracked by writes to the main resource;
  writes to ``/status`` track ``status`` alone, in entries with ``subresource: status``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .resources import ApiError, clone, now_iso

Path = tuple[Any, ...]  # str field names, ("k", name) for list items, "." for the item
MISSING = object()
SERVER_META = {
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
    "generateName",
}


def keyed(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in value)
    )


def _leaves(value: Any, prefix: Path) -> Iterator[tuple[Path, Any]]:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(v, (*prefix, k))
    elif keyed(value):
        for item in value:
            p = (*prefix, ("k", item["name"]))
            yield (*p, "."), True
            yield from _leaves(item, p)
    else:
        yield prefix, value


def leaves(obj: dict[str, Any] | None, sub: str | None = None) -> dict[Path, Any]:
    """Leaf path -> value of the tracked part of ``obj`` (not status, not server metadata;
    with ``sub="status"``: status alone)."""
    out: dict[Path, Any] = {}
    if not obj or sub is not None:
        return dict(_leaves(obj[sub], (sub,))) if obj and sub in obj else out
    for k, v in obj.items():
        if k in ("apiVersion", "kind", "status"):
            continue
        if k == "metadata":
            for mk, mv in v.items():
                if mk not in SERVER_META:
                    out.update(_leaves(mv, ("metadata", mk)))
            continue
        out.update(_leaves(v, (k,)))
    return out


def value_at(obj: Any, path: Path) -> Any:
    for seg in path:
        if seg == ".":
            return True
        if isinstance(seg, tuple):
            if not isinstance(obj, list):
                return MISSING
            obj = next((i for i in obj if isinstance(i, dict) and i.get("name") == seg[1]), None)
            if obj is None:
                return MISSING
        elif isinstance(obj, dict) and seg in obj:
            obj = obj[seg]
        else:
            return MISSING
    return obj


def _remove(obj: Any, path: Path) -> None:
    """Remove the leaf at ``path`` (or the list item, for a ``.`` path); prune empty maps."""
    if path[-1] == ".":
        path = path[:-1]
    parent = value_at(obj, path[:-1]) if len(path) > 1 else obj
    seg = path[-1]
    if isinstance(seg, tuple) and isinstance(parent, list):
        parent[:] = [i for i in parent if i.get("name") != seg[1]]
        now_empty = not parent
    elif isinstance(parent, dict) and seg in parent:
        del parent[seg]
        now_empty = not parent
    else:
        return
    if now_empty and len(path) > 2:
        _remove(obj, path[:-1])


def to_fields(paths: set[Path]) -> dict[str, Any]:
    """Leaf paths -> ``fieldsV1``."""
    root: dict[str, Any] = {}
    for path in sorted(paths, key=repr):
        node = root
        for seg in path:
            if seg == ".":
                name = "."
            elif isinstance(seg, tuple):
                name = "k:" + json.dumps({"name": seg[1]}, separators=(",", ":"))
            else:
                name = "f:" + seg
            node = node.setdefault(name, {})
    return root


def from_fields(fields: dict[str, Any], prefix: Path = ()) -> set[Path]:
    """``fieldsV1`` -> leaf paths (``v:`` and ``i:`` members are not produced here)."""
    out: set[Path] = set()
    for name, sub in fields.items():
        if name == ".":
            seg: Any = "."
        elif name.startswith("f:"):
            seg = name[2:]
        elif name.startswith("k:"):
            seg = ("k", json.loads(name[2:]).get("name"))
        else:
            continue
        if sub:
            out |= from_fields(sub, (*prefix, seg))
        else:
            out.add((*prefix, seg))
    return out


def path_text(path: Path) -> str:
    """``.spec.template.spec.containers[name="app"].image`` like the real server."""
    out = ""
    for seg in path:
        if seg == ".":
            continue
        out += f'[name="{seg[1]}"]' if isinstance(seg, tuple) else "." + seg
    return out


class Managed:
    """The ``managedFields`` of an object as (entry, paths) pairs: those of subresource
    ``sub`` (None: the main resource, whose ``spec.replicas`` writes through the ``scale``
    subresource own too); the others are kept as they are."""

    def __init__(self, entries: list[dict[str, Any]] | None, sub: str | None = None) -> None:
        self.entries, self.sub = list(entries or ()), sub
        subs = (None, "scale") if sub is None else (sub,)
        self.items = [
            (e, from_fields(e.get("fieldsV1") or {}))
            for e in self.entries
            if e.get("subresource") in subs
        ]

    def mine(self, entry: dict[str, Any], manager: str, operation: str) -> bool:
        return (entry.get("manager"), entry.get("operation"), entry.get("subresource")) == (
            manager,
            operation,
            self.sub,
        )

    def find(self, manager: str, operation: str) -> set[Path]:
        for e, paths in self.items:
            if self.mine(e, manager, operation):
                return paths
        return set()

    def others(self, manager: str) -> list[tuple[dict[str, Any], set[Path]]]:
        return [(e, p) for e, p in self.items if e.get("manager") != manager]

    def render(self, manager: str, operation: str, paths: set[Path], api_version: str) -> list:
        """The entries after ``manager``'s ``operation`` now owns ``paths`` (order kept; an
        entry whose fields did not change keeps its time, so a no-op write changes nothing)."""
        out: list[Any] = []
        fields = to_fields(paths)
        mine: dict[str, Any] | None = {
            "manager": manager,
            "operation": operation,
            "apiVersion": api_version,
            "time": now_iso(),
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        }
        if self.sub is not None:
            mine["subresource"] = self.sub
        owned = {id(e): p for e, p in self.items}
        for e in self.entries:
            if id(e) not in owned:
                out.append(e)
                continue
            p = owned[id(e)]
            if self.mine(e, manager, operation):
                assert mine is not None
                if e.get("fieldsV1") == fields and e.get("apiVersion") == api_version:
                    mine["time"] = e.get("time", mine["time"])
                out.append(mine)
                mine = None
            elif p:
                rendered = to_fields(p)
                out.append(e if rendered == e.get("fieldsV1") else dict(e, fieldsV1=rendered))
        if mine is not None:
            out.append(mine)
        return [e for e in out if e.get("fieldsV1")]


def _who(entry: dict[str, Any]) -> str:
    text = f'"{entry.get("manager")}" using {entry.get("apiVersion")}'
    if entry.get("operation") == "Update" and entry.get("time"):
        text += f" at {entry['time']}"
    return text


def conflict_error(conflicts: list[tuple[dict[str, Any], Path]]) -> ApiError:
    causes = [
        {
            "reason": "FieldManagerConflict",
            "message": f"conflict with {_who(e)}",
            "field": path_text(p),
        }
        for e, p in conflicts
    ]
    if len(conflicts) == 1:
        e, p = conflicts[0]
        text = f"Apply failed with 1 conflict: conflict with {_who(e)}: {path_text(p)}"
    else:
        by_who: dict[str, list[str]] = {}
        for e, p in conflicts:
            by_who.setdefault(_who(e), []).append(path_text(p))
        lines = []
        for who in sorted(by_who):
            lines.append(f"conflicts with {who}:")
            lines += [f"- {p}" for p in by_who[who]]
        text = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, "Conflict", text, {"causes": causes})


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _merge_apply(live: dict[str, Any], config: dict[str, Any]) -> None:
    for k, v in config.items():
        cur = live.get(k)
        if isinstance(v, dict) and v and isinstance(cur, dict):
            _merge_apply(cur, v)
        elif keyed(v) and (keyed(cur) or cur == []):
            by_name = {i["name"]: i for i in cur}
            for item in v:
                if item["name"] in by_name:
                    _merge_apply(by_name[item["name"]], item)
                else:
                    cur.append(clone(item))
        else:
            live[k] = clone(v)


def server_side_apply(
    live: dict[str, Any] | None,
    config: dict[str, Any],
    manager: str,
    force: bool,
    api_version: str,
    sub: str | None = None,
) -> dict[str, Any]:
    """The object after ``manager`` applies ``config`` to ``live`` (None: create); ``sub``:
    to that subresource (``config`` then holds only what it may change)."""
    config = _drop_nulls(config)
    managed = Managed((live or {}).get("metadata", {}).get("managedFields"), sub)
    wanted = leaves(config, sub)
    conflicts: list[tuple[dict[str, Any], Path]] = []
    for path, value in wanted.items():
        if path[-1] == "." or value_at(live, path) == value:
            continue
        conflicts += [(e, path) for e, owned in managed.others(manager) if path in owned]
    if conflicts and not force:
        raise conflict_error(conflicts)
    for e, path in conflicts:
        for entry, owned in managed.items:
            if entry is e:
                owned.discard(path)
    obj = clone(live) if live else {}
    before = managed.find(manager, "Apply")
    owned_by_others = set().union(*(p for _, p in managed.others(manager)))
    for path in sorted(before - set(wanted), key=len, reverse=True):
        if path[-1] == "name" and len(path) > 1 and isinstance(path[-2], tuple):
            continue  # an item's key goes with the item (its "." path)
        if path[-1] == ".":
            inside = path[:-1]
            if any(o[: len(inside)] == inside for o in owned_by_others):
                continue
        elif path in owned_by_others:
            continue
        _remove(obj, path)
    _merge_apply(obj, config)
    obj.setdefault("metadata", {})["managedFields"] = managed.render(
        manager, "Apply", set(wanted), api_version
    )
    return obj


def track_update(
    old: dict[str, Any] | None,
    new: dict[str, Any],
    manager: str,
    api_version: str,
    sub: str | None = None,
) -> None:
    """Record in ``new``'s managedFields that ``manager`` (operation Update) wrote it."""
    managed = Managed((old or {}).get("metadata", {}).get("managedFields"), sub)
    old_leaves, new_leaves = leaves(old, sub), leaves(new, sub)
    changed = {p for p, v in new_leaves.items() if old_leaves.get(p, MISSING) != v}
    gone = set(old_leaves) - set(new_leaves)
    mine = set(managed.find(manager, "Update"))
    for entry, owned in managed.items:
        if not managed.mine(entry, manager, "Update"):
            owned -= changed | gone
    mine = (mine | changed) - gone
    new.setdefault("metadata", {})["managedFields"] = managed.render(
        manager, "Update", mine, api_version
    )
