"""The REST verbs on stored objects: create, replace, the patch kinds (server-side apply
included), delete with garbage collection, and reads. Each write runs, under the store's
lock: status carried over, defaulting, validation (``custom`` for the kinds of CRDs, ``crds``
for CRDs themselves), field-ownership bookkeeping, storage. Status writes: ``status``."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

from . import crds, custom, status
from .apply import server_side_apply, track_update
from .defaults import apply_defaults
from .patches import APPLY, JSON_PATCH, STRATEGIC, json_patch, merge_patch, parse_body, patch_type
from .resources import (
    BY_KIND,
    ApiError,
    Res,
    bad_request,
    clone,
    invalid,
    not_found,
    stale,
    suffix,
)
from .store import Obj, Store
from .validate import validate

RETURNS_OBJECT = {"Pod", "Service", "ServiceAccount", "Namespace"}
NS_MISMATCH = (
    "the namespace of the provided object does not match the namespace sent on the request"
)
JOB_DELETE_WARNING = (
    '299 - "child pods are preserved by default when jobs are deleted; set '
    "propagationPolicy=Background to remove them or set propagationPolicy=Orphan to "
    'suppress this warning"'
)


def _name_mismatch(body_name: str, url_name: str) -> ApiError:
    return bad_request(
        f"the name of the object ({body_name}) does not match the name on the URL ({url_name})"
    )


class Api:
    """The verbs, over one ``Store``. ``context`` (per thread) holds the request's
    ``fieldValidation`` and collects the warnings to answer with."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.context = threading.local()
        # kind -> a check beyond what a CRD's schema can say (a test sets the Gateway API's
        # published schema, run by node): the complaint, or None when it accepts the object
        self.admission: dict[str, Callable[[Obj], str | None]] = {}
        crds.attach(store)

    def begin(self, field_validation: str | None) -> None:
        """A request starts on this thread."""
        self.context.validation, self.context.warnings = field_validation, []

    def warnings(self) -> list[str]:
        return list(getattr(self.context, "warnings", ()))

    def _custom(self, res: Res, new: Obj) -> None:
        """Admit an object of a CRD's kind (``new`` read as ``res``'s version), stored with
        the storage version's apiVersion."""
        kind = self.store.kinds.custom[res.kind]
        found = custom.admit(kind, res.version, new, getattr(self.context, "validation", None))
        if found and hasattr(self.context, "warnings"):
            self.context.warnings += found
        new["apiVersion"] = kind.res.api_version
        check = self.admission.get(res.kind)
        complaint = check(new) if check is not None else None
        if complaint:
            name = str(new["metadata"].get("name", ""))
            raise invalid(res, name, [("", complaint, "FieldValueInvalid")])

    # ---- helpers
    def _check_type(self, res: Res, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise bad_request(f"the body of the request was not a {res.kind} object")
        if body.get("apiVersion") != res.api_version or body.get("kind") != res.kind:
            have = f"{body.get('apiVersion', '')}, Kind={body.get('kind', '')}"
            raise bad_request(
                f"the object provided is unrecognized ({have}) or does not match the "
                f"expected {res.api_version}, Kind={res.kind}"
            )
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        body.setdefault("metadata", {})
        return body

    def _place(self, res: Res, ns: str, body: Obj) -> None:
        meta = body["metadata"]
        if res.namespaced:
            if meta.get("namespace", ns) != ns:
                raise bad_request(NS_MISMATCH)
            meta["namespace"] = ns
            if self.store.peek("Namespace", "", ns) is None:
                raise not_found(BY_KIND["Namespace"], ns)
        else:
            meta.pop("namespace", None)

    def _finish(self, res: Res, new: Obj, old: Obj | None, manager: str | None) -> None:
        """Status carried over, defaults, validation, ownership (``manager``: an Update)."""
        if self.store.kinds.has_status(res.kind):
            if old is not None and "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        if res.kind == "Namespace":
            new["status"] = (old or {}).get("status") or {"phase": "Active"}
        meta = new["metadata"]
        if old is not None:
            for field in ("name", "namespace", "uid", "creationTimestamp"):
                if field in old["metadata"]:
                    meta[field] = old["metadata"][field]
        apply_defaults(new, old)
        if res.kind in self.store.kinds.custom:
            self._custom(res, new)
        else:
            validate(new, old)
        if res.kind == crds.KIND:
            crds.admit(new, old, self.store.kinds)
        if manager is not None:
            track_update(old, new, manager, res.api_version)

    # ---- reads
    def get(self, res: Res, ns: str, name: str) -> Obj:
        obj = self.store.get(res.kind, ns, name)
        if obj is None:
            raise not_found(res, name)
        return obj

    def list(self, res: Res, ns: str | None, labels: str | None, fields: str | None) -> Obj:
        found, rv = self.store.list(res.kind, ns, labels, fields, copy=False)
        if res.kind in self.store.kinds.custom:  # served as unstructured: kind and apiVersion
            items = [dict(o, apiVersion=res.api_version) for o in found]
        else:
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in found]
        meta = {"resourceVersion": rv}
        return {
            "kind": res.list_kind or f"{res.kind}List",
            "apiVersion": res.api_version,
            "metadata": meta,
            "items": items,
        }

    # ---- writes
    def create(self, res: Res, ns: str, body: Any, manager: str, dry_run: bool = False) -> Obj:
        body = self._check_type(res, body)
        meta = body["metadata"]
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        for field in (
            "uid",
            "creationTimestamp",
            "generation",
            "managedFields",
            "deletionTimestamp",
        ):
            meta.pop(field, None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                cause = (
                    "metadata.name",
                    "Required value: name or generateName is required",
                    "FieldValueRequired",
                )
                raise invalid(res, "", [cause])
            meta["name"] = meta["generateName"] + suffix()
        with self.store.lock:
            self._place(res, ns, body)
            meta["uid"] = str(uuid.uuid4())
            self._finish(res, body, None, manager)
            if dry_run:
                return body
            return self.store.create(body)

    def replace(
        self, res: Res, ns: str, name: str, body: Any, manager: str, dry_run: bool = False
    ) -> Obj:
        body = self._check_type(res, body)
        meta = body["metadata"]
        if meta.get("name", name) != name:
            raise _name_mismatch(meta["name"], name)
        meta["name"] = name
        with self.store.lock:
            self._place(res, ns, body)
            old = self.store.peek(res.kind, ns, name)
            if old is None:
                raise not_found(res, name)
            expect = meta.get("resourceVersion")
            if expect and expect != old["metadata"]["resourceVersion"]:
                raise stale(res, name)
            meta["managedFields"] = clone(old["metadata"].get("managedFields") or [])
            self._finish(res, body, old, manager)
            return body if dry_run else self.store.update(body, expect)

    def patch(
        self,
        res: Res,
        ns: str,
        name: str,
        raw: bytes,
        content_type: str,
        manager: str | None,
        force: bool = False,
        dry_run: bool = False,
    ) -> tuple[int, Obj]:
        """(201 when server-side apply created the object, else 200, the object)."""
        ctype = patch_type(content_type, res.kind in self.store.kinds.custom)
        body = parse_body(raw, yaml_ok=ctype == APPLY)
        with self.store.lock:
            old = self.store.peek(res.kind, ns, name)
            if ctype == APPLY:
                return self._apply(res, ns, name, body, old, manager, force, dry_run)
            if old is None:
                raise not_found(res, name)
            if ctype == JSON_PATCH:
                if not isinstance(body, list):
                    raise bad_request("json patch must be a list of operations")
                new = json_patch(old, body)
            else:
                if not isinstance(body, dict):
                    raise bad_request("patch must be a JSON object")
                new = merge_patch(old, body, strategic=ctype == STRATEGIC)
            new = self._check_type(res, new)
            expect = (
                (body.get("metadata") or {}).get("resourceVersion")
                if isinstance(body, dict)
                else None
            )
            if expect and expect != old["metadata"]["resourceVersion"]:
                raise stale(res, name)
            new["metadata"]["managedFields"] = clone(old["metadata"].get("managedFields") or [])
            self._finish(res, new, old, manager or "unknown")
            return 200, new if dry_run else self.store.update(new)

    def _apply(
        self,
        res: Res,
        ns: str,
        name: str,
        config: Any,
        old: Obj | None,
        manager: str | None,
        force: bool,
        dry_run: bool,
    ) -> tuple[int, Obj]:
        if not manager:
            raise bad_request("fieldManager is required for apply requests")
        config = self._check_type(res, config)
        meta = config["metadata"]
        if meta.get("name", name) != name:
            raise _name_mismatch(meta["name"], name)
        if res.namespaced and meta.get("namespace", ns) != ns:
            raise bad_request(NS_MISMATCH)
        expect = meta.pop("resourceVersion", None)
        if expect and (old is None or expect != old["metadata"]["resourceVersion"]):
            raise stale(res, name) if old is not None else not_found(res, name)
        for field in ("uid", "creationTimestamp", "generation", "managedFields"):
            meta.pop(field, None)
        new = server_side_apply(old, config, manager, force, res.api_version)
        new["apiVersion"], new["kind"] = res.api_version, res.kind
        new["metadata"]["name"] = name
        if old is None:
            self._place(res, ns, new)
            new["metadata"]["uid"] = str(uuid.uuid4())
        self._finish(res, new, old, None)
        if dry_run:
            return (201 if old is None else 200), new
        if old is None:
            return 201, self.store.create(new)
        return 200, self.store.update(new)

    def write_status(
        self,
        res: Res,
        ns: str,
        name: str,
        raw: bytes,
        content_type: str | None,
        manager: str | None,
        force: bool = False,
    ) -> Obj:
        """PUT (``content_type`` None), patch or server-side apply of the status subresource."""
        return status.write(self, res, ns, name, raw, content_type, manager, force)

    # ---- deletes
    def delete(
        self, res: Res, ns: str, name: str, options: dict[str, Any]
    ) -> tuple[Obj, dict[str, str]]:
        """(response body, extra headers) of a DELETE."""
        headers: dict[str, str] = {}
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy is None:
            policy = "Orphan" if res.kind == "Job" else "Background"
            if res.kind == "Job":
                headers["Warning"] = JOB_DELETE_WARNING
        if policy not in ("Orphan", "Background", "Foreground"):
            cause = (
                "propagationPolicy",
                f'Unsupported value: "{policy}"',
                "FieldValueNotSupported",
            )
            raise invalid(res, name, [cause])
        with self.store.lock:
            old = self.store.peek(res.kind, ns, name)
            if old is None:
                raise not_found(res, name)
            pre = options.get("preconditions") or {}
            if (
                pre.get("resourceVersion")
                and pre["resourceVersion"] != old["metadata"]["resourceVersion"]
            ):
                raise stale(res, name)
            if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
                raise stale(res, name)
            gone = self.remove(res.kind, ns, name, policy)
        if res.kind in RETURNS_OBJECT:
            if res.kind == "Namespace":
                gone = dict(gone, status={"phase": "Terminating"})
            return gone, headers
        details = {"name": name, "kind": res.plural, "uid": gone["metadata"]["uid"]}
        if res.group:
            details["group"] = res.group
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": details,
        }
        return status, headers

    def remove(self, kind: str, ns: str, name: str, policy: str = "Background") -> Obj:
        """Delete an object now, its dependents per ``policy`` (and a namespace's contents)."""
        with self.store.lock:
            obj = self.store.peek(kind, ns, name)
            if obj is None:
                raise not_found(self.store.kinds.res(kind), name)
            uid = obj["metadata"]["uid"]
            for dep in self.store.owned_by(uid):
                dkind, dns, dname = (
                    dep["kind"],
                    dep["metadata"].get("namespace", ""),
                    dep["metadata"]["name"],
                )
                if policy == "Orphan":
                    refs = [
                        r
                        for r in dep["metadata"].get("ownerReferences") or ()
                        if r.get("uid") != uid
                    ]
                    meta = dict(dep["metadata"], ownerReferences=refs)
                    if not refs:
                        del meta["ownerReferences"]
                    self.store.update(dict(dep, metadata=meta))
                else:
                    self.remove(dkind, dns, dname, "Background")
            if kind == "Namespace":
                for k in self.store.kinds.namespaced_kinds():
                    for o in self.store.scan(k, name):
                        if self.store.peek(k, name, o["metadata"]["name"]) is not None:
                            self.remove(k, name, o["metadata"]["name"])
            served = crds.served_by(self.store.kinds, name) if kind == crds.KIND else None
            for o in self.store.scan(served.kind) if served else ():
                meta = o["metadata"]
                if self.store.peek(served.kind, meta.get("namespace", ""), meta["name"]):
                    self.remove(served.kind, meta.get("namespace", ""), meta["name"])
            return self.store.delete(kind, ns, name)

    def delete_collection(
        self,
        res: Res,
        ns: str | None,
        labels: str | None,
        fields: str | None,
        options: dict[str, Any],
    ) -> Obj:
        listing = self.list(res, ns, labels, fields)
        policy = options.get("propagationPolicy") or (
            "Orphan" if res.kind == "Job" else "Background"
        )
        for item in listing["items"]:
            meta = item["metadata"]
            if self.store.peek(res.kind, meta.get("namespace", ""), meta["name"]) is not None:
                self.remove(res.kind, meta.get("namespace", ""), meta["name"], policy)
        return listing
