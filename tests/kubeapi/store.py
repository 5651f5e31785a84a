"""The object store of the fake API server: objects by (kind, namespace, name), one global
resourceVersion counter, uid / generation / creationTimestamp, an owner index for garbage
collection, a bounded event log for watches, and label / field selectors.

Stored dicts are never changed in place: every write stores a fresh dict, so readers inside
the package may hold references (``peek``, and what ``create``/``update``/``delete``
return) while callers outside the package get copies (``get``, ``list``)."""

from __future__ import annotations

import re
import threading
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

from .resources import (
    NO_GENERATION,
    ApiError,
    Registry,
    already_exists,
    bad_request,
    clone,
    not_found,
    now_iso,
    stale,
    suffix,
)

Obj = dict[str, Any]
Key = tuple[str, str, str]  # kind, namespace ("" when cluster-scoped), name
Listener = Callable[[str, Obj | None, Obj | None], None]  # kind, new, old


def key_of(obj: Obj) -> Key:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


class Store:
    """Thread-safe object storage; ``listeners`` hear every change (kind, new, old);
    ``kinds`` is the registry of served kinds (custom ones come and go with their CRDs)."""

    def __init__(self, events: int = 20000) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.kinds = Registry()
        self._objects: defaultdict[str, dict[tuple[str, str], Obj]] = defaultdict(dict)
        self._rv = 0
        self.events: deque[tuple[int, str, str, Obj]] = deque(maxlen=events)
        self._owned: dict[str, set[Key]] = defaultdict(set)
        self.listeners: list[Listener] = []
        self.closed = False
        self._compacted = 0  # resourceVersions before this are gone from history (410)
        # watch behaviour (tests/kubeapi/watch.py): how often an idle watch gets a BOOKMARK
        # (the real server: about once a minute, and shortly before its timeout), and a
        # counter that, when bumped, cuts every open watch mid-stream
        self.bookmark_sec = 60.0
        self.watch_drops = 0

    # ---- reading
    @property
    def resource_version(self) -> str:
        return str(self._rv)

    def peek(self, kind: str, namespace: str, name: str) -> Obj | None:
        """The stored object itself: never change it."""
        return self._objects[kind].get((namespace, name))

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        with self.lock:
            obj = self._objects[kind].get((namespace, name))
            return clone(obj) if obj is not None else None

    def scan(self, kind: str, namespace: str | None = None) -> list[Obj]:
        """Stored objects (references, do not change them) in name order."""
        with self.lock:
            items = self._objects[kind].items()
            return [o for (ns, _), o in sorted(items) if namespace is None or ns == namespace]

    def owned_by(self, uid: str) -> list[Obj]:
        with self.lock:
            out = [self.peek(*k) for k in sorted(self._owned.get(uid, ()))]
            return [o for o in out if o is not None]

    def list(
        self,
        kind: str,
        namespace: str | None = None,
        labels: str | None = None,
        fields: str | None = None,
        copy: bool = True,
    ) -> tuple[list[Obj], str]:
        """Matching objects in name order (``copy=False``: the stored dicts, read-only)."""
        label_reqs = parse_label_selector(labels) if labels else []
        field_reqs = parse_field_selector(kind, fields) if fields else []
        with self.lock:
            out = [
                clone(o) if copy else o
                for o in self.scan(kind, namespace)
                if matches(label_reqs, o["metadata"].get("labels") or {})
                and all(match_field(o, req) for req in field_reqs)
            ]
            return out, self.resource_version

    # ---- writing
    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, kind: str, new: Obj | None, old: Obj | None) -> None:
        for o, add in ((old, False), (new, True)):
            if o is None:
                continue
            k = key_of(o)
            for ref in o["metadata"].get("ownerReferences") or ():
                if add:
                    self._owned[ref["uid"]].add(k)
                else:
                    self._owned[ref["uid"]].discard(k)
        etype = "DELETED" if new is None else ("ADDED" if old is None else "MODIFIED")
        obj = new if new is not None else old
        assert obj is not None
        self.events.append((int(obj["metadata"]["resourceVersion"]), etype, kind, obj))
        self.changed.notify_all()
        for listener in list(self.listeners):
            listener(kind, new, old)

    def create(self, obj: Obj) -> Obj:
        """Store a new object (taking ownership of ``obj``); server fields are set here."""
        kind = obj["kind"]
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        with self.lock:
            table = self._objects[kind]
            if not meta.get("name"):
                base = meta.get("generateName", "")
                while not meta.get("name") or (ns, meta["name"]) in table:
                    meta["name"] = base + suffix()
            if (ns, meta["name"]) in table:
                raise already_exists(self.kinds.res(kind), meta["name"])
            meta["uid"] = meta.get("uid") or str(uuid.uuid4())
            meta["creationTimestamp"] = now_iso()
            meta["resourceVersion"] = self._bump()
            if self.kinds.generation_of(kind, obj) is not NO_GENERATION:
                meta["generation"] = 1
            else:
                meta.pop("generation", None)
            table[(ns, meta["name"])] = obj
            self._record(kind, obj, None)
            return obj

    def update(self, obj: Obj, expect_rv: str | None = None) -> Obj:
        """Replace a stored object; a change-free write keeps the resourceVersion."""
        kind, ns, name = key_of(obj)
        # its own metadata: a caller's ``dict(stored, status=...)`` shares the stored one's,
        # and the version it replaces (in a watch's history, a write's answer) must not change
        obj = dict(obj, metadata=dict(obj["metadata"]))
        meta = obj["metadata"]
        with self.lock:
            old = self._objects[kind].get((ns, name))
            if old is None:
                raise not_found(self.kinds.res(kind), name)
            old_meta = old["metadata"]
            if expect_rv and expect_rv != old_meta["resourceVersion"]:
                raise stale(self.kinds.res(kind), name)
            for field in ("uid", "creationTimestamp", "deletionTimestamp"):
                if field in old_meta:
                    meta[field] = old_meta[field]
            spec = self.kinds.generation_of(kind, obj)
            if spec is not NO_GENERATION:
                gen = old_meta.get("generation", 1)
                meta["generation"] = gen + (spec != self.kinds.generation_of(kind, old))
            meta["resourceVersion"] = old_meta["resourceVersion"]
            if obj == old:
                return old
            meta["resourceVersion"] = self._bump()
            self._objects[kind][(ns, name)] = obj
            self._record(kind, obj, old)
            return obj

    def delete(self, kind: str, namespace: str, name: str) -> Obj:
        with self.lock:
            old = self._objects[kind].pop((namespace, name), None)
            if old is None:
                raise not_found(self.kinds.res(kind), name)
            gone = dict(old, metadata=dict(old["metadata"], resourceVersion=self._bump()))
            self._record(kind, None, gone)
            return gone

    def events_after(self, rv: int, kinds: Iterable[str]) -> list[tuple[int, str, str, Obj]]:
        """Events newer than ``rv``; ``ApiError`` 410 when the log no longer reaches back."""
        wanted = set(kinds)
        with self.lock:
            too_old = rv < self._compacted or (self.events and rv < self.events[0][0] - 1)
            if too_old:
                raise ApiError(410, "Expired", f"too old resource version: {rv} ({self._rv})")
            # from the newest back (the log is in version order): a watch that is up to date
            # costs the few events it has not seen, not the whole log (10,000 functions)
            newer = []
            for event in reversed(self.events):
                if event[0] <= rv:
                    break
                if event[2] in wanted:
                    newer.append(event)
            newer.reverse()
            return newer

    def compact(self) -> None:
        """Forget the history of changes, as etcd's compaction does: a watch from any
        resourceVersion before now gets ``410 Gone``."""
        with self.lock:
            self.events.clear()
            self._compacted = self._rv
            self.changed.notify_all()

    def drop_watches(self) -> None:
        """Cut every open watch mid-stream (no final chunk), as a proxy or a restarting API
        server would."""
        with self.lock:
            self.watch_drops += 1
            self.changed.notify_all()


# ---- label selectors
Req = tuple[str, str, tuple[str, ...]]  # key, operator (= != in notin exists !), values
_SET = re.compile(r"^\s*([^\s=!(),]+)\s+(in|notin)\s*\(([^()]*)\)\s*$")
_EQ = re.compile(r"^\s*([^\s=!(),]+)\s*(==|=|!=)\s*([^\s=!(),]*)\s*$")
_NOT = re.compile(r"^\s*!\s*([^\s=!(),]+)\s*$")
_HAS = re.compile(r"^\s*([^\s=!(),]+)\s*$")


def _split(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def parse_label_selector(text: str) -> list[Req]:
    """Parse ``a=b,c!=d,e in (x,y),f notin (z),g,!h``; ``ApiError`` 400 when malformed."""
    reqs: list[Req] = []
    for part in _split(text):
        if m := _SET.match(part):
            values = tuple(v.strip() for v in m[3].split(","))
            reqs.append((m[1], m[2], values))
        elif m := _EQ.match(part):
            reqs.append((m[1], "!=" if m[2] == "!=" else "=", (m[3],)))
        elif m := _NOT.match(part):
            reqs.append((m[1], "!", ()))
        elif m := _HAS.match(part):
            reqs.append((m[1], "exists", ()))
        else:
            raise bad_request(f"unable to parse requirement: {part.strip()!r}")
    return reqs


def matches(reqs: Iterable[Req], labels: dict[str, str]) -> bool:
    for key, op, values in reqs:
        has = key in labels
        value = labels.get(key)
        if op in ("=", "in"):
            ok = has and value in values
        elif op in ("!=", "notin"):
            ok = not has or value not in values
        else:
            ok = has == (op == "exists")
        if not ok:
            return False
    return True


def selector_reqs(selector: dict[str, Any] | None) -> list[Req]:
    """Requirements of a ``LabelSelector`` (matchLabels + matchExpressions)."""
    selector = selector or {}
    reqs: list[Req] = [(k, "=", (v,)) for k, v in (selector.get("matchLabels") or {}).items()]
    ops = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}
    for expr in selector.get("matchExpressions") or ():
        reqs.append((expr["key"], ops[expr["operator"]], tuple(expr.get("values") or ())))
    return reqs


# ---- field selectors
_FIELDS: dict[str, dict[str, str]] = {
    "Pod": {
        "spec.nodeName": "spec.nodeName",
        "spec.restartPolicy": "spec.restartPolicy",
        "spec.schedulerName": "spec.schedulerName",
        "spec.serviceAccountName": "spec.serviceAccountName",
        "status.phase": "status.phase",
        "status.podIP": "status.podIP",
    },
    "Secret": {"type": "type"},
    "Job": {"status.successful": "status.succeeded"},
}
FieldReq = tuple[str, bool, str]  # object path, equal?, value


def parse_field_selector(kind: str, text: str) -> list[FieldReq]:
    allowed = {"metadata.name": "metadata.name", "metadata.namespace": "metadata.namespace"}
    allowed.update(_FIELDS.get(kind, {}))
    reqs = []
    for part in text.split(","):
        m = re.match(r"^\s*([^=!\s]+)\s*(==|=|!=)\s*(\S*)\s*$", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        if m[1] not in allowed:
            raise bad_request(f"field label not supported: {m[1]}")
        reqs.append((allowed[m[1]], m[2] != "!=", m[3]))
    return reqs


def match_field(obj: Obj, req: FieldReq) -> bool:
    path, equal, want = req
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    have = "" if value is None else str(value)
    return (have == want) == equal
