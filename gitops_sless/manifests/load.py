"""Manifests: every ``sless.yaml`` of a snapshot, checked, as typed functions.

Loading never stops at the first bad file. Each manifest is checked on its own
(YAML, schema, entrypoint files and their code, cron schedules, symlinks), then the checks
that span files (unique names, job references). A manifest with any problem
contributes no functions and is reported as invalid with every problem found;
the others load.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestError, ManifestProblem
from ..source.snapshot import Snapshot
from . import blocks, cron, durations, handlers, runtimes, schema, triggers, yamldoc
from .identity import MANIFEST_NAME, build_tag, source_id
from .model import (
    DEFAULT_MAX,
    CronTrigger,
    DesiredState,
    Function,
    Job,
    read_env,
)
from .yamldoc import Located, YamlProblem, field_path

__all__ = [
    "MANIFEST_NAME",
    "ManifestCache",
    "load",
]


# --- one manifest ------------------------------------------------------------


class _Manifest:
    """One sless.yaml while it is being checked."""

    def __init__(self, snapshot: Snapshot, path: str) -> None:
        self.snapshot = snapshot
        self.path = path
        self.folder = posixpath.dirname(path)
        self.problems: list[ManifestProblem] = []
        self.doc: Located | None = None
        self.data: dict[str, Any] = {}
        self._schema_bad: list[tuple[str | int, ...]] = []  # where the schema found problems
        self._declared: tuple[tuple[yamldoc.Path, str, str], ...] | None = None
        self._job_refs: tuple[tuple[yamldoc.Path, str], ...] | None = None

    def problem(self, at: yamldoc.Path, reason: str, line: int | None = None) -> None:
        if line is None:
            line = self.doc.line_of(at) if self.doc else 1
        self.problems.append(ManifestProblem(self.path, line, field_path(at), reason))

    def folder_files(self) -> dict[str, str]:
        """Files of the folder (relative path -> kind), checking symlinks and submodules."""
        files: dict[str, str] = {}
        links: dict[str, str] = {}
        for path, entry in self.snapshot.walk(self.folder):
            rel = posixpath.relpath(path, self.folder) if self.folder else path
            if entry.kind == "submodule":
                reason = f"{rel} is a git submodule; its code is not in the repository"
                self.problem(("(folder)",), reason, 1)
            elif entry.kind == "link":
                links[rel] = self.snapshot.read(path).decode("utf-8", "replace")
            if entry.kind in ("blob", "link"):
                files[rel] = entry.kind
        for rel, target in links.items():
            self._check_link(rel, target, links)
        return files

    def _check_link(self, rel: str, target: str, links: dict[str, str]) -> None:
        if target.startswith("/"):
            self.problem(("(folder)",), f"symlink {rel} -> {target} is an absolute path", 1)
        elif _resolve_in_folder(rel, links) is None:
            self.problem(
                ("(folder)",), f"symlink {rel} -> {target} points outside the function folder", 1
            )

    def parse(self) -> None:
        entry_kind = {e.name: e.kind for e in self.snapshot.entries(self.folder)}[MANIFEST_NAME]
        if entry_kind != "blob":
            self.problem(
                ("(file)",), f"{MANIFEST_NAME} must be a regular file, not a {entry_kind}", 1
            )
            return
        try:
            self.doc = yamldoc.load(self.snapshot.read(self.path))
        except YamlProblem as exc:
            self.problem(exc.path or ("(file)",), exc.reason, exc.line)
            return
        if self.doc.data is None:
            self.problem(("functions",), "is required (the file is empty)", 1)
            return
        for at, reason in schema.check(self.doc.data):
            self.problem(at, reason)
            self._schema_bad.append(tuple(at))
        if not self.problems:
            self.data = schema.apply_defaults(self.doc.data)

    def check_functions(self) -> None:
        """The checks the schema cannot make (files, schedules), on every part of every
        function the schema let through: a bad name never hides a bad schedule."""
        data = self.doc.data if self.doc is not None and self._schema_bad else self.data
        functions = data.get("functions") if isinstance(data, dict) else None
        if not isinstance(functions, list):
            return
        files: dict[str, str] | None = None
        for i, fn in enumerate(functions):
            at = ("functions", i)
            if not isinstance(fn, dict):
                continue
            if self._valid(*at, "entrypoint") and self._valid(*at, "runtime"):
                files = self.folder_files() if files is None else files
                self._check_entrypoint(at, fn, files)
            if "triggers" in fn and self._valid(*at, "triggers"):
                self._check_triggers(at, fn)
            self._check_scaling(at, self._written(i))

    def _valid(self, *at: str | int) -> bool:
        """Whether the schema found nothing wrong at ``at``, in it or around it."""
        return not any(bad[: len(at)] == at or at[: len(bad)] == bad for bad in self._schema_bad)

    def _check_entrypoint(
        self, at: yamldoc.Path, fn: dict[str, Any], files: dict[str, str]
    ) -> None:
        module, _, _ = fn["entrypoint"].rpartition(".")
        at = (*at, "entrypoint")
        if module.startswith("/"):
            self.problem(
                at, f"{fn['entrypoint']!r} is an absolute path; give a path inside the folder"
            )
            return
        parts = module.split("/")
        if ".." in parts or "." in parts or "" in parts:
            self.problem(
                at, f"{fn['entrypoint']!r}: '..', '.' and empty path segments are not allowed"
            )
            return
        runtime = runtimes.get(fn["runtime"])
        wanted = module + runtime.extension
        where = posixpath.join(self.folder, wanted)
        if wanted not in files:
            self.problem(at, f"{where} does not exist (runtime {fn['runtime']})")
        elif files[wanted] == "blob":  # a link's target is checked where it is
            read = self.snapshot.read
            esm = runtime.interpreter == "node" and handlers.loads_as_esm(
                wanted, files, lambda rel: read(posixpath.join(self.folder, rel))
            )
            source = read(where)  # its entrypoint's function, and a websocket trigger's hooks
            hooks = [((*at[:-1], "triggers", *p), n) for p, n in triggers.hooks(fn.get("triggers"))]
            named = [(at, fn["entrypoint"].rpartition(".")[2]), *hooks]
            for name_at, function in (n for n in named if self._valid(*n[0])):
                found = handlers.check(runtime.interpreter, source, function, esm)
                if found is not None and found.in_code:
                    self.problems.append(ManifestProblem(where, found.line, "(code)", found.reason))
                    return
                if found is not None:
                    self.problem(name_at, f"{where} {found.reason}")

    def _check_triggers(self, at: yamldoc.Path, fn: dict[str, Any]) -> None:
        for where, why in triggers.problems(fn["triggers"]):
            self.problem((*at, "triggers", *where), why)

    def _written(self, i: int) -> dict[str, Any]:
        """Function ``i`` as the file writes it, before the schema's defaults."""
        assert self.doc is not None
        return self.doc.data["functions"][i]

    def _check_scaling(self, at: yamldoc.Path, fn: dict[str, Any]) -> None:
        """``replicas`` or ``scale``, never both; in each scale block, min and every warm floor
        at most max, warm schedules that parse, durations within their bounds."""
        if "scale" in fn and "replicas" in fn:
            self.problem(
                (*at, "scale"),
                "a function names replicas or scale, not both (replicas: N is scale min N, max N)",
            )
        preview = fn.get("preview")
        blocks = {
            ("scale",): fn.get("scale"),
            ("preview", "scale"): preview.get("scale") if isinstance(preview, dict) else None,
        }
        for where, block in blocks.items():
            if isinstance(block, dict):
                self._check_scale((*at, *where), block)
        durations = {"async": ("backoff", "maxBackoff", "maxAge"), "rollout": ("interval",)}
        for block, names in durations.items():
            policy = fn.get(block)
            for name in names if isinstance(policy, dict) else ():
                if name in policy and self._valid(*at, block, name):
                    self._check_duration((*at, block, name), policy[name], _bounds(block, name))
        rollout = fn.get("rollout")
        steps = rollout.get("steps") if isinstance(rollout, dict) else None
        if isinstance(steps, list) and self._valid(*at, "rollout", "steps"):
            for j in (j for j in range(1, len(steps)) if steps[j] <= steps[j - 1]):
                where, said = (*at, "rollout", "steps", j), f"{steps[j]} after {steps[j - 1]}"
                self.problem(where, f"{said}: the steps must increase")

    def _check_scale(self, at: yamldoc.Path, block: dict[str, Any]) -> None:
        """One scale block, every part of it the schema let through."""
        high = block.get("max", DEFAULT_MAX) if self._valid(*at, "max") else None
        default = "" if "max" in block else " (the default)"
        low = block.get("min", 0) if self._valid(*at, "min") else None
        if low is not None and high is not None and low > high:
            self.problem((*at, "min"), f"{low} is more than max {high}{default}")
        if "idle" in block and self._valid(*at, "idle"):
            self._check_duration((*at, "idle"), block["idle"], _bounds("scale", "idle"))
        warms = block.get("warm", [])
        for j, warm in enumerate(warms if isinstance(warms, list) else []):
            w = (*at, "warm", j)
            if self._valid(*w, "cron"):
                try:
                    cron.parse(warm["cron"])
                except cron.CronError as exc:
                    self.problem((*w, "cron"), str(exc))
            if self._valid(*w, "for"):
                self._check_duration((*w, "for"), warm["for"], _bounds("warm", "for"))
            if self._valid(*w, "min") and high is not None and warm["min"] > high:
                self.problem(
                    (*w, "min"),
                    f"{warm['min']} is more than max {high}{default}: a floor never exceeds max",
                )

    def _check_duration(self, at: yamldoc.Path, value: Any, bounds: tuple[int, int]) -> None:
        """The bounds of a duration written as a string (the schema bounds whole seconds)."""
        if not isinstance(value, str):
            return
        try:
            seconds = durations.parse(value)
        except durations.DurationError as exc:
            self.problem(at, str(exc))
            return
        low, high = bounds
        if seconds < low:
            self.problem(at, f'"{value}" is less than the minimum of {durations.shown(low)}')
        elif seconds > high:
            self.problem(at, f'"{value}" is greater than the maximum of {durations.shown(high)}')

    def declared(self) -> tuple[tuple[yamldoc.Path, str, str], ...]:
        """(path, name, what) of every function and job name, read as far as possible."""
        if self._declared is None:
            self._declared = tuple(self._read_declared())
        return self._declared

    def job_refs(self) -> tuple[tuple[yamldoc.Path, str], ...]:
        """(path, job) of every ``{job: NAME}`` in an env of a valid manifest."""
        if self._job_refs is None:
            self._job_refs = tuple(self._read_job_refs())
        return self._job_refs

    def _read_job_refs(self) -> Iterable[tuple[yamldoc.Path, str]]:
        for i, fn in enumerate(self.data.get("functions", [])):
            envs = [(("env",), fn["env"]), (("preview", "env"), fn["preview"].get("env", {}))]
            for where, env in envs:
                for var, value in env.items():
                    if isinstance(value, dict) and "job" in value:
                        yield ("functions", i, *where, var, "job"), value["job"]

    def _read_declared(self) -> Iterable[tuple[yamldoc.Path, str, str]]:
        data = self.doc.data if self.doc else None
        functions = data.get("functions") if isinstance(data, dict) else None
        for i, fn in enumerate(functions if isinstance(functions, list) else []):
            if not isinstance(fn, dict):
                continue
            if isinstance(fn.get("name"), str):
                yield ("functions", i, "name"), fn["name"], "function"
            jobs = fn.get("jobs")
            for j, job in enumerate(jobs if isinstance(jobs, list) else []):
                if isinstance(job, dict) and isinstance(job.get("name"), str):
                    yield ("functions", i, "jobs", j, "name"), job["name"], "job"

    def functions(self) -> list[Function]:
        # the folder without this file: an edit of the manifest alone builds nothing
        folder_id = source_id(self.snapshot, self.folder)
        return [
            _function(self, fn, folder_id, "replicas" in self._written(i))
            for i, fn in enumerate(self.data["functions"])
        ]


def _resolve_in_folder(rel: str, links: Mapping[str, str], hops: int = 0) -> str | None:
    """Where ``rel`` leads once every link on the way is followed; None if outside the folder.

    Resolving link by link (not the link's own text alone) catches chains such
    as ``up -> ..`` plus ``out -> up/..`` that each look harmless.
    """
    out: list[str] = []
    for part in rel.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not out:
                return None
            out.pop()
            continue
        out.append(part)
        current = "/".join(out)
        if current in links:
            target = links[current]
            if target.startswith("/") or hops > 40:  # absolute, or a loop
                return None
            resolved = _resolve_in_folder(
                posixpath.join(posixpath.dirname(current), target), links, hops + 1
            )
            if resolved is None:
                return None
            out = resolved.split("/") if resolved else []
    return "/".join(out)


def _bounds(definition: str, name: str) -> tuple[int, int]:
    """The schema's bounds of a duration field, in seconds."""
    prop = schema.load_schema()["$defs"][definition]["properties"][name]
    return prop["minimum"], prop["maximum"]


def _function(
    manifest: _Manifest, fn: dict[str, Any], source_id: str, replicas_named: bool
) -> Function:
    runtime = runtimes.get(fn["runtime"])
    return Function(
        name=fn["name"],
        folder=manifest.folder,
        manifest=manifest.path,
        runtime=fn["runtime"],
        entrypoint=fn["entrypoint"],
        memory_mb=fn["memoryMB"],
        timeout_sec=fn["timeoutSec"],
        replicas=fn["replicas"],
        enabled=fn["enabled"],
        env=read_env(fn["env"]),
        preview_env=read_env(fn["preview"].get("env", {})),
        crons=tuple(
            CronTrigger(t["schedule"], t["event"]) for t in fn["triggers"] if t["type"] == "cron"
        ),
        jobs=tuple(Job(j["name"], j["runId"], j["event"], fn["name"]) for j in fn["jobs"]),
        source_id=source_id,
        build_tag=build_tag(source_id, runtime),
        max_processes=fn["maxProcesses"],
        same_origin=any(t.get("sameOrigin", False) for t in fn["triggers"] if t["type"] == "http"),
        scale=blocks.scale(fn.get("scale")),
        preview_scale=blocks.scale(fn["preview"].get("scale")),
        replicas_named=replicas_named,
        concurrency=fn["concurrency"],
        rate_limit=blocks.rate_limit(fn.get("rateLimit")),
        max_body_bytes=fn.get("maxBodyBytes"),
        async_policy=blocks.async_policy(fn["async"]),
        subjects=tuple(sorted({t["subject"] for t in fn["triggers"] if t["type"] == "queue"})),
        rollout=blocks.rollout(fn.get("rollout")),
        stream=blocks.stream(fn.get("stream")),
        **triggers.served(fn["triggers"]),
    )


# --- the whole repository ------------------------------------------------------


# (a manifest's path below a tree, the tree id of the manifest's folder)
_Found = tuple[tuple[str, str], ...]


def _find_manifests(
    snapshot: Snapshot, memo: dict[str, _Found], live: dict[str, _Found]
) -> list[str]:
    """Every sless.yaml, sorted. A tree already searched (``memo``, by tree id) is not read
    again: a commit that changes one folder reads the trees on the way to it."""
    found = _below(snapshot, "", snapshot.tree_id(""), memo, live)
    for path, folder_id in found:
        snapshot.know(path.rpartition("/")[0], folder_id)
    return sorted(path for path, _ in found)


def _below(
    snapshot: Snapshot, folder: str, tree_id: str, memo: dict[str, _Found], live: dict[str, _Found]
) -> _Found:
    found = memo.get(tree_id)
    if found is None:
        out: list[tuple[str, str]] = []
        for entry in snapshot.entries(folder):
            path = f"{folder}/{entry.name}" if folder else entry.name
            if entry.kind == "tree":
                snapshot.know(path, entry.oid)
                below = _below(snapshot, path, entry.oid, memo, live)
                out += [(f"{entry.name}/{rel}", oid) for rel, oid in below]
            elif entry.name == MANIFEST_NAME and entry.kind in ("blob", "link"):
                out.append((entry.name, tree_id))
        found = tuple(out)
    live[tree_id] = found
    return found


def _check_unique_names(manifests: list[_Manifest]) -> None:
    """Function and job names share one namespace across the repository."""
    seen: dict[str, list[tuple[_Manifest, yamldoc.Path, str]]] = {}
    for m in manifests:
        for at, name, what in m.declared():
            seen.setdefault(name, []).append((m, at, what))
    for name, places in seen.items():
        for m, at, what in places[1:] if len(places) > 1 else []:
            first_m, first_at, first_what = places[0]
            line = first_m.doc.line_of(first_at) if first_m.doc else 1
            m.problem(
                at,
                f"{what} name {name!r} is already used by a {first_what} at {first_m.path}:{line}",
            )
        if len(places) > 1:
            m, at, what = places[0]
            other_m, other_at, other_what = places[1]
            line = other_m.doc.line_of(other_at) if other_m.doc else 1
            m.problem(
                at, f"{what} name {name!r} is also used by a {other_what} at {other_m.path}:{line}"
            )


def _check_job_references(manifests: list[_Manifest]) -> None:
    declared_jobs = {name for m in manifests for _, name, what in m.declared() if what == "job"}
    for m in manifests:
        for at, job in m.job_refs():
            if job not in declared_jobs:
                m.problem(at, f"job {job!r} is not defined in this repository")


class ManifestCache:
    """Per-manifest results of the checks that read only the manifest's own folder.

    Keyed by the folder's tree id (which covers the manifest and every file
    next to it), so a commit that changes one folder re-checks one folder. The
    checks that span files run on every load; they are cheap.
    """

    def __init__(self) -> None:
        # (doc, data, problems, declared names, job references) by (path, folder tree id)
        self._entries: dict[tuple[str, str], tuple[Any, ...]] = {}
        # the same folder gives the same Function objects: whoever remembers work per
        # function (a deployment's hash, its job dependencies) finds it again
        self._functions: dict[tuple[str, str], list[Function]] = {}
        self._trees: dict[str, _Found] = {}  # tree id -> the manifests below it
        self.last: _Loaded | None = None

    def find(self, snapshot: Snapshot) -> list[str]:
        live: dict[str, _Found] = {}
        paths = _find_manifests(snapshot, self._trees, live)
        self._trees = live  # only the trees of the newest snapshot
        return paths

    def functions(self, m: _Manifest) -> list[Function]:
        key = (m.path, m.snapshot.tree_id(m.folder))
        if key not in self._functions:
            self._functions[key] = m.functions()
        return self._functions[key]

    def checked(self, snapshot: Snapshot, path: str) -> _Manifest:
        m = _Manifest(snapshot, path)
        key = (path, snapshot.tree_id(m.folder))
        if key in self._entries:
            m.doc, m.data, problems, m._declared, m._job_refs = self._entries[key]
            m.problems = list(problems)
            return m
        m.parse()
        m.check_functions()
        self._entries[key] = (m.doc, m.data, list(m.problems), m.declared(), m.job_refs())
        return m

    def keep_only(self, manifests: list[_Manifest]) -> None:
        live = {(m.path, m.snapshot.tree_id(m.folder)) for m in manifests}
        self._entries = {k: v for k, v in self._entries.items() if k in live}
        self._functions = {k: v for k, v in self._functions.items() if k in live}

    def forget(self, path: str, tree_id: str) -> None:
        self._entries.pop((path, tree_id), None)
        self._functions.pop((path, tree_id), None)


@dataclass
class _Outline:
    """What the checks that span files read of one manifest."""

    tree_id: str  # of its folder
    valid: bool
    declared: tuple[tuple[yamldoc.Path, str, str], ...]
    job_refs: tuple[tuple[yamldoc.Path, str], ...]

    @classmethod
    def of(cls, m: _Manifest, own_problems: int) -> _Outline:
        valid = own_problems == 0
        return cls(m.snapshot.tree_id(m.folder), valid, m.declared(), m.job_refs())


@dataclass
class _Loaded:
    """The last load, which a commit that changes a few folders starts from."""

    snapshot: Snapshot
    manifests: dict[str, _Outline]
    state: DesiredState  # as loaded, before anyone added to it


def _touched(changed: Mapping[str, bool], manifests: Mapping[str, _Outline]) -> set[str] | None:
    """The manifests whose folder holds a changed file; None when one was added or removed."""
    touched: set[str] = set()
    for path, exists in changed.items():
        if posixpath.basename(path) == MANIFEST_NAME and exists != (path in manifests):
            return None
        folder = posixpath.dirname(path)
        while True:
            candidate = f"{folder}/{MANIFEST_NAME}" if folder else MANIFEST_NAME
            if candidate in manifests:
                touched.add(candidate)
            if not folder:
                break
            folder = posixpath.dirname(folder)
    return touched


def _load_changed(snapshot: Snapshot, cache: ManifestCache) -> DesiredState | None:
    """The last load with the touched manifests checked again, when nothing the checks that
    span files read changed (the same names and job references; no problem between files);
    otherwise None, and everything is loaded (a folder that did not change is not checked
    again either way)."""
    last = cache.last
    if last is None:
        return None
    if last.snapshot.revision == snapshot.revision:
        return _copy(last.state)
    changed = snapshot.changed_since(last.snapshot)
    touched = _touched(changed, last.manifests) if changed is not None else None
    if touched is None:
        return None
    state = DesiredState(
        snapshot.revision,
        dict(last.state.functions),
        dict(last.state.invalid),
        dict(last.state.invalid_names),
    )
    manifests = dict(last.manifests)
    for path in sorted(touched):
        before = manifests[path]
        m = cache.checked(snapshot, path)
        after = _Outline.of(m, len(m.problems))
        if (after.valid, after.declared, after.job_refs) != (
            before.valid,
            before.declared,
            before.job_refs,
        ):
            return None
        cache.forget(path, before.tree_id)
        manifests[path] = after
        if m.problems:
            state.invalid[path] = ManifestError(m.problems)
        else:  # the same names: each takes its place, and the order stays that of a load
            for fn in cache.functions(m):
                state.functions[fn.name] = fn
    cache.last = _Loaded(snapshot, manifests, _copy(state))
    return state


def _copy(state: DesiredState) -> DesiredState:
    return DesiredState(
        state.revision, dict(state.functions), dict(state.invalid), dict(state.invalid_names)
    )


def load(snapshot: Snapshot, cache: ManifestCache | None = None) -> DesiredState:
    """Every function of ``snapshot``; invalid manifests are reported, not raised."""
    cache = cache or ManifestCache()
    quick = _load_changed(snapshot, cache)
    if quick is not None:
        return quick
    manifests = [cache.checked(snapshot, path) for path in cache.find(snapshot)]
    cache.keep_only(manifests)
    own = [len(m.problems) for m in manifests]
    _check_unique_names(manifests)
    _check_job_references(manifests)
    outlines = {m.path: _Outline.of(m, n) for m, n in zip(manifests, own, strict=True)}
    across = any(len(m.problems) != n for m, n in zip(manifests, own, strict=True))
    state = DesiredState(revision=snapshot.revision)
    for m in manifests:
        if m.problems:
            state.invalid[m.path] = ManifestError(m.problems)
            for _, name, what in m.declared():
                if what == "function":
                    state.invalid_names[name] = m.path
        else:
            for fn in cache.functions(m):
                state.functions[fn.name] = fn
    # a problem between files may go away with a change elsewhere: then every load is whole
    cache.last = None if across else _Loaded(snapshot, outlines, _copy(state))
    return state
