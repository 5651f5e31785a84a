"""Local builds: a function folder plus its dependencies, in an artifact folder per build tag.

An artifact is ``root/<tag>/``: the function folder's files (without its
``sless.yaml``, which is not part of the build), written from the snapshot (git
objects, never a checkout), and its dependencies (``.sless-deps/`` for pip,
``node_modules/`` for npm). A build happens in ``root/.tmp-<tag>-<random>/`` and
is renamed into place when it succeeded; the marker file ``.sless-build.json``
is written last, so an artifact is either complete or not built at all, also
after a crash. A built tag is never built again: tags are content-derived, so
the same tag is the same content.

Dependencies are installed once per key (the runtime and what the install
reads, see ``gitops_sless.manifests.dependencies``) into ``root/.deps/<key>/`` and
hard-linked into each artifact that needs them (see ``depcache``): a code change
that leaves ``requirements.txt`` or ``package.json`` as they were runs no installer.

Installers run as ``installers`` describes (scrubbed environment, own process
group, the build's deadline, the sandbox). ``close()`` kills the running ones
and refuses further builds (shutdown).

A built artifact is made read-only, files and folders, once its marker is
written; the sandbox mounts it read-only as well (a root reconciler's
processes would ignore the modes): nothing that runs from it changes what a
later start runs. Removing it makes it writable again first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import TransientError
from ..manifests.dependencies import Dependencies, dependencies, input_paths
from ..manifests.identity import MANIFEST_NAME, is_manifest, source_id
from ..manifests.model import Function
from ..manifests.yamldoc import YamlProblem
from ..manifests.yamldoc import load as load_yaml
from ..paths import stays_inside
from ..plan.backend import BuildFailed
from ..source.snapshot import Snapshot
from .depcache import DependencyCache, link_tree
from .installers import BuildCancelled, BuildLog, Installers, build_environment, group_alive, now
from .leftovers import UnsafeOutput, check_output
from .orphans import ProcessGroups
from .sandbox import Sandbox

__all__ = [
    "MARKER",
    "BuildCancelled",
    "BuildFailed",
    "BuildResult",
    "LocalBuilder",
    "SourceChanged",
    "build_environment",
]

MARKER = ".sless-build.json"
DEPS_DIR = ".sless-deps"
DEPS_CACHE = ".deps"  # below root: the dependency cache
TMP_PREFIX = ".tmp-"
# what each installer leaves in its folder: the part an artifact gets
OUTPUTS = {"requirements.txt": DEPS_DIR, "package.json": "node_modules"}
CLOSE_WAIT_SEC = 10.0

logger = logging.getLogger(__name__)

# a tag names a folder below root: nothing that could climb out or hide as a dotfile
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class SourceChanged(TransientError):
    """A file changed while it was read (a directory being edited): build again later."""


@dataclass(frozen=True)
class BuildResult:
    tag: str
    path: Path
    log: str
    duration_sec: float
    # True when no build ran in this call: the artifact existed, or another
    # caller was building the same tag and this one waited for it
    cached: bool


@dataclass(frozen=True)
class _Job:
    """What every step of one build needs."""

    tag: str
    snapshot: Snapshot
    folder: str
    env: dict[str, str]
    deadline: float
    log: BuildLog


class _Pending:
    """A build in progress, for callers that ask for the same tag meanwhile."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: BuildResult | None = None
        self.error: Exception | None = None


class LocalBuilder:
    """Builds functions into ``root/<tag>/`` folders, each tag at most once."""

    def __init__(
        self,
        root: Path,
        max_concurrent: int = 2,
        timeout_sec: float = 600,
        python: str | None = None,
        npm: str = "npm",
        groups: ProcessGroups | None = None,
        sandbox: Sandbox | None = None,
    ) -> None:
        """``python`` runs pip: by default this interpreter, or the system's ``python3``
        in a sandbox (which sees only the system's)."""
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {max_concurrent}")
        self.root = Path(root)
        self.timeout_sec = timeout_sec
        sandbox = sandbox or Sandbox()
        self.python = python or ("python3" if sandbox.enabled else sys.executable)
        self.npm = npm
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._built: set[str] = set()
        self.root.mkdir(parents=True, exist_ok=True)
        # installers of a killed predecessor must not finish a build this process redoes
        self.groups = groups or ProcessGroups(self.root.parent / "pids" / "builds")
        self.groups.stop_orphans()
        self.installers = Installers(self.groups, sandbox)
        self._remove_leftovers()
        self.deps = DependencyCache(self.root / DEPS_CACHE)

    # --- artifacts ---------------------------------------------------------

    def path(self, tag: str) -> Path:
        """The artifact folder of ``tag`` (whether built or not)."""
        if not _TAG.fullmatch(tag):
            raise ValueError(f"{tag!r} is not a build tag")
        return self.root / tag

    def log_path(self, tag: str) -> Path:
        """The log of the last build of ``tag``, failed or not."""
        return self.root / f"{self.path(tag).name}.log"

    def is_built(self, tag: str) -> bool:
        """True only for a complete artifact: its marker is written after everything else."""
        if tag in self._built:  # artifacts are immutable: no need to read the marker again
            return True
        try:
            marker = json.loads((self.path(tag) / MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        built = isinstance(marker, dict) and marker.get("tag") == tag
        if built:
            self._built.add(tag)
        return built

    def marker(self, tag: str) -> dict[str, Any]:
        """What the build of ``tag`` recorded (runtime, folder, finished); {} if unreadable."""
        try:
            marker = json.loads((self.path(tag) / MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return marker if isinstance(marker, dict) else {}

    def building(self) -> set[str]:
        """Tags being built right now."""
        with self._lock:
            return set(self._pending)

    def tags(self) -> list[str]:
        """Every built tag."""
        return sorted(
            item.name
            for item in self.root.iterdir()
            if _TAG.fullmatch(item.name) and item.is_dir() and self.is_built(item.name)
        )

    def remove(self, tag: str) -> bool:
        """Delete the artifact and log of ``tag``; False when there was none.

        The artifact first stops counting as built, then leaves its place in one
        rename, so nobody ever sees half of it as a built tag.
        """
        target = self.path(tag)
        doomed: Path | None = None
        with self._lock:
            if tag in self._pending:
                raise RuntimeError(f"{tag} is being built; it cannot be removed now")
            self._built.discard(tag)
            if target.exists():
                # an artifact folder is read-only: only root may unlink in it as it is, and
                # a folder moves with its ".."
                _make_writable(target, recursive=False)
                (target / MARKER).unlink(missing_ok=True)
                doomed = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{tag}-rm-", dir=self.root))
                os.rename(target, doomed / tag)
            self.log_path(tag).unlink(missing_ok=True)
        if doomed is None:
            return False
        _remove_path(doomed)
        return True

    def _remove_leftovers(self) -> None:
        # Temp folders of a process that crashed mid-build, and artifacts renamed
        # into place whose marker was never written. A root belongs to one
        # reconciler process, so nothing here can belong to a live build.
        for item in self.root.iterdir():
            temporary = item.name.startswith(TMP_PREFIX)
            unmarked = _TAG.fullmatch(item.name) and item.is_dir() and not self.is_built(item.name)
            if temporary or unmarked:
                _remove_path(item)

    # --- building ----------------------------------------------------------

    def build(self, fn: Function, snapshot: Snapshot) -> BuildResult:
        """Build ``fn`` from ``snapshot``, or return the artifact already built.

        Blocks until done. Raises ``BuildFailed`` when an installer fails or the
        build runs past ``timeout_sec``, ``SourceChanged`` when a file of a
        directory snapshot changed while it was read, and ``BuildCancelled``
        once ``close()`` was called. ``snapshot`` must be the
        one ``fn`` was loaded from (``ValueError`` otherwise): a tag must only
        ever hold the content it names.
        """
        tag = fn.build_tag
        started = time.monotonic()
        path = self.path(tag)
        if self.is_built(tag):
            return self._cached(tag, started)
        while True:
            with self._lock:
                pending = self._pending.get(tag)
                owner = pending is None
                if pending is None:
                    # a build of this tag may have finished since the check above
                    if self.is_built(tag):
                        return self._cached(tag, started)
                    self.installers.check_open(tag)
                    pending = self._pending[tag] = _Pending()
            if owner:
                break
            pending.done.wait()
            if pending.result is not None:
                return replace(pending.result, cached=True, duration_sec=time.monotonic() - started)
            # another caller's attempt failed (a fork's build, in another trust scope):
            # its failure is not this caller's, which makes an attempt of its own
            if not isinstance(pending.error, BuildFailed):
                raise pending.error or BuildFailed(tag, "the build was interrupted")
        try:
            with self._slots:
                pending.result = self._build(fn, snapshot, path)
            return pending.result
        except Exception as exc:
            pending.error = exc
            raise
        finally:
            with self._lock:
                del self._pending[tag]
            pending.done.set()

    def _cached(self, tag: str, started: float) -> BuildResult:
        try:
            log = self.log_path(tag).read_text(encoding="utf-8", errors="replace")
        except OSError:
            log = ""
        return BuildResult(tag, self.path(tag), log, time.monotonic() - started, cached=True)

    def _build(self, fn: Function, snapshot: Snapshot, final: Path) -> BuildResult:
        tag = fn.build_tag
        found = source_id(snapshot, fn.folder)
        if found != fn.source_id:
            raise ValueError(
                f"{fn.name}: folder {fn.folder or '.'} of {snapshot.revision[:12]} has source "
                f"{found}, the function was loaded with {fn.source_id}"
            )
        # the deadline starts once a build slot is free: queueing is not building
        started = time.monotonic()
        deadline = started + self.timeout_sec
        env, secrets = build_environment(os.environ)
        try:
            log = BuildLog(self.log_path(tag), secrets)
        except OSError as exc:
            raise BuildFailed(tag, f"cannot write the build log: {exc}") from exc
        tmp: Path | None = None
        try:
            self.installers.check_open(tag)
            log.line(f"build {tag}: {_what_is_built(fn, snapshot)} at {snapshot.revision}")
            deps = dependencies(fn, snapshot)
            tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{tag}-", dir=self.root))
            tmp.chmod(0o755)
            count = _lay_out(tag, snapshot, fn.folder, tmp, _all_but_manifest(fn.folder))
            log.line(f"laid out {count} entries")
            job = _Job(tag, snapshot, fn.folder, env, deadline, log)
            with contextlib.ExitStack() as held:
                if deps is not None:
                    held.enter_context(self.deps.use(deps.key))
                    self._add_dependencies(deps, job, tmp)
                # a crash between rename and marker leaves an unmarked folder: not built
                if final.exists():
                    _remove_path(final)
                os.rename(tmp, final)
                tmp = None
                duration = time.monotonic() - started
                log.line(f"built {tag} in {duration:.1f} s")
                # written while the dependencies are held: from now on the
                # marker names them, so the collector keeps them
                _write_marker(final, tag, fn, snapshot, duration, deps.key if deps else None)
            _make_read_only(final)
            return BuildResult(tag, final, log.text(), duration, cached=False)
        except OSError as exc:
            log.line(f"FAILED: {exc}")
            raise BuildFailed(tag, str(exc), log.tail()) from exc
        except BuildFailed as exc:
            log.line(f"FAILED: {exc.reason}")
            exc.log_tail = log.tail()
            raise
        except Exception as exc:
            # SourceChanged, BuildCancelled, or an unreadable snapshot: not this
            # build's fault, but its log must still say how it ended
            log.line(f"FAILED: {exc}")
            raise
        finally:
            log.close()
            if tmp is not None:
                _remove_path(tmp)

    # --- dependencies ------------------------------------------------------

    def _add_dependencies(self, deps: Dependencies, job: _Job, artifact: Path) -> None:
        """Install ``deps`` into the cache unless they are there, then link them in."""
        key = deps.key
        wait = job.deadline - time.monotonic()
        try:
            installed = self.deps.ensure(key, lambda folder: self._install(deps, job, folder), wait)
        except TimeoutError as exc:
            raise BuildFailed(job.tag, f"timed out after {self.timeout_sec:g} s: {exc}") from None
        except BuildFailed as exc:
            if exc.tag == job.tag:
                raise
            # the build that was installing the same dependencies failed: so does this one
            raise BuildFailed(job.tag, f"dependencies {key}: {exc.reason}", exc.log_tail) from exc
        if not installed:
            job.log.line(f"dependencies: reusing {key} ({self._installed_by(key)})")
        output = OUTPUTS[deps.dependency_file]
        source = self.deps.path(key) / output
        if not source.exists():  # nothing to install (a requirements.txt of comments)
            job.log.line(f"dependencies: {key} installed nothing")
            return
        _remove_path(artifact / output)  # the installer's result replaces the folder's own
        link_tree(source, artifact / output)
        job.log.line(f"dependencies: linked {output}/ from {key}")

    def _installed_by(self, key: str) -> str:
        marker = self.deps.marker(key)
        return f"installed by build {marker.get('tag', '?')} at {marker.get('finished', '?')}"

    def _install(self, deps: Dependencies, job: _Job, folder: Path) -> dict[str, Any]:
        """Run the installer of ``deps`` in ``folder``; keep only what it produced."""
        started = time.monotonic()
        job.log.line(f"dependencies: installing {deps.key} from {deps.describe()}")
        inputs = set(input_paths(deps, job.snapshot, job.folder))
        _lay_out(job.tag, job.snapshot, job.folder, folder, inputs.__contains__)
        for step, command in self._commands(deps.dependency_file, folder):
            self.installers.run(
                job.tag, step, command, folder, job.env, job.deadline, self.timeout_sec, job.log
            )
        output = OUTPUTS[deps.dependency_file]
        for item in folder.iterdir():
            if item.name != output:
                _remove_path(item)
        if os.path.lexists(folder / output):
            try:
                count = check_output(folder / output, within=folder)
            except UnsafeOutput as exc:
                raise BuildFailed(job.tag, f"dependencies: {exc}", job.log.tail()) from None
            job.log.line(f"dependencies: {output}/ holds {count} entries")
        took = time.monotonic() - started
        job.log.line(f"dependencies: installed {deps.key} in {took:.1f} s")
        return {"tag": job.tag, "inputs": deps.describe(), "finished": now()}

    def _commands(self, dependency_file: str, folder: Path) -> list[tuple[str, list[str]]]:
        if dependency_file == "requirements.txt":
            # --target keeps every installed file inside the folder, never in
            # the environment the reconciler runs in
            return [
                (
                    "pip install",
                    [
                        self.python,
                        "-m",
                        "pip",
                        "install",
                        "--no-input",
                        "--disable-pip-version-check",
                        "--target",
                        str(folder / DEPS_DIR),
                        "-r",
                        dependency_file,
                    ],
                )
            ]
        if dependency_file == "package.json":
            return [("npm install", [self.npm, "install", "--omit=dev", "--no-audit", "--no-fund"])]
        raise ValueError(f"no installer for {dependency_file}")

    # --- shutdown ----------------------------------------------------------

    def close(self, wait_sec: float = CLOSE_WAIT_SEC) -> None:
        """Kill every running installer's process group and refuse further builds.

        Returns once the builds in progress have ended (they raise
        ``BuildCancelled`` and remove their temporary folders) and no process
        of a killed group is left, or after ``wait_sec``. Safe to call twice.
        """
        killed = self.installers.close()
        deadline = time.monotonic() + wait_sec
        while time.monotonic() < deadline:
            with self._lock:
                busy = bool(self._pending) or self.installers.running()
            if not busy and not any(group_alive(pgid) for pgid in killed):
                return
            time.sleep(0.02)
        logger.warning("builder closed with builds or installers still ending")


def _all_but_manifest(folder: str) -> Callable[[str], bool]:
    # the root sless.yaml is not part of the build (see identity)
    return lambda path: not is_manifest(folder, path)


def _lay_out(
    tag: str, snapshot: Snapshot, folder: str, target: Path, include: Callable[[str], bool]
) -> int:
    """Write the entries of ``folder`` that ``include`` (their snapshot paths) below ``target``.

    Returns how many entries were written.
    """
    links: list[Path] = []
    count = 0
    for path, entry in snapshot.walk(folder):
        if not include(path):
            continue
        rel = posixpath.relpath(path, folder) if folder else path
        dest = target / rel
        if entry.kind == "tree":
            dest.mkdir(mode=0o755)
        elif entry.kind == "blob":
            data = _verified(snapshot, path, entry.oid)
            mode = 0o755 if entry.mode & 0o111 else 0o644
            # O_EXCL | O_NOFOLLOW: never write through something already there
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.chmod(dest, mode)  # the umask must not take the exec bit away
        elif entry.kind == "link":
            link_target = _verified(snapshot, path, entry.oid).decode("utf-8", "surrogateescape")
            # the manifest loader refuses these already; a tag must not depend on that
            if not stays_inside(rel, link_target):
                raise BuildFailed(tag, f"symlink {rel} -> {link_target} leaves the folder")
            os.symlink(link_target, dest)
            links.append(dest)
        else:
            raise BuildFailed(tag, f"{rel} is a {entry.kind}; it cannot be built")
        count += 1
    # Each link stays inside by itself; a chain through other links is only
    # known once all exist, so resolve them for real.
    inside = target.resolve()
    for link in links:
        if not link.resolve().is_relative_to(inside):
            rel = link.relative_to(target)
            raise BuildFailed(tag, f"symlink {rel} resolves outside the folder")
    return count


def _verified(snapshot: Snapshot, path: str, oid: str) -> bytes:
    # A directory snapshot reads files when asked: one edited since the scan
    # would be built under a tag that names other content.
    data = snapshot.read(path)
    if hashlib.sha1(b"blob %d\0%s" % (len(data), data)).hexdigest() != oid:
        raise SourceChanged(f"{path} changed while it was being built")
    return data


def _write_marker(
    folder: Path,
    tag: str,
    fn: Function,
    snapshot: Snapshot,
    duration: float,
    dependencies_key: str | None,
) -> None:
    marker = {
        "tag": tag,
        "runtime": fn.runtime,
        "source_id": fn.source_id,
        "folder": fn.folder,
        "revision": snapshot.revision,
        "dependencies": dependencies_key,
        "duration_sec": round(duration, 3),
        "finished": now(),
    }
    partial = folder / f"{MARKER}.partial"
    partial.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, folder / MARKER)


def _make_read_only(folder: Path) -> None:
    """chmod a-w, files and folders, ``folder`` last (symlinks have no mode of their own)."""
    for parent, folders, files in os.walk(folder, topdown=False):
        for name in [*files, *folders]:
            _chmod(os.path.join(parent, name), ~0o222)
    _chmod(str(folder), ~0o222)


def _make_writable(folder: Path, recursive: bool = True) -> None:
    """u+w on ``folder`` (and the folders below it): what deleting their entries needs."""
    _chmod(str(folder), ~0, add=stat.S_IWUSR)
    if recursive:
        for parent, folders, _ in os.walk(folder):
            for name in folders:
                _chmod(os.path.join(parent, name), ~0, add=stat.S_IWUSR)


def _chmod(path: str, keep: int, add: int = 0) -> None:
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if not stat.S_ISLNK(mode):
            os.chmod(path, (stat.S_IMODE(mode) & keep) | add)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        _make_writable(path)  # an artifact is read-only once built
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _what_is_built(fn: Function, snapshot: Snapshot) -> str:
    """The folder and every function the build serves: each function of the folder's
    manifest with ``fn``'s runtime shares its tag, so one log is all of theirs."""
    names = _sharing(fn, snapshot) or [fn.name]
    word = "function" if len(names) == 1 else "functions"
    return f"folder {fn.folder or '.'} ({fn.runtime}): {word} {', '.join(names)}"


def _sharing(fn: Function, snapshot: Snapshot) -> list[str]:
    try:
        raw = snapshot.read(posixpath.join(fn.folder, MANIFEST_NAME))
        declared = load_yaml(raw).data["functions"]
        names = [f["name"] for f in declared if f.get("runtime") == fn.runtime]
    except (OSError, KeyError, TypeError, AttributeError, YamlProblem):
        return []  # it was valid when fn was loaded from it; the log still names fn
    return sorted(n for n in names if isinstance(n, str)) if fn.name in names else []
