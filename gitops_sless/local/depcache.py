"""Installed dependencies, once per key, shared by the artifacts that need them.

An entry is ``root/<key>/`` (``root`` is ``artifacts/.deps``) holding what the
installer produced (``.sless-deps/`` or ``node_modules/``) and, written last,
the marker ``.sless-deps.json``. It is installed in ``root/.tmp-<key>-<random>/``
and renamed into place, like an artifact, so an entry is complete or absent,
also after a crash. Builders asking for the same key at once wait for the one
that installs it. The key names what the install read (see
``gitops_sless.manifests.dependencies``), so an entry never changes once published.

Artifacts get their dependencies as hard links to an entry's files (``cp -al``),
not as a link to the entry: an artifact folder stays self-contained (a sandbox
can mount it alone, read-only, and the runtime imports from inside it), costs
no second copy on disk, and outlives the entry if the collector removes it.
The entry's files are made read-only, so a function cannot write through a
shared inode into other artifacts' dependencies.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["DEPS_MARKER", "DependencyCache", "link_tree"]

DEPS_MARKER = ".sless-deps.json"
TMP_PREFIX = ".tmp-"
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class DependencyCache:
    """Entries below ``root``, each installed at most once at a time."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)  # made by the first install
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._users: Counter[str] = Counter()
        self._ready: set[str] = set()
        self._remove_leftovers()

    def path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise ValueError(f"{key!r} is not a dependency key")
        return self.root / key

    def marker(self, key: str) -> dict[str, Any]:
        """What the install of ``key`` recorded; {} when it is not complete."""
        try:
            marker = json.loads((self.path(key) / DEPS_MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return marker if isinstance(marker, dict) and marker.get("key") == key else {}

    def is_ready(self, key: str) -> bool:
        if key in self._ready:
            return True
        ready = bool(self.marker(key))
        if ready:
            self._ready.add(key)
        return ready

    def installed(self) -> list[str]:
        """Every complete entry."""
        return sorted(
            item.name
            for item in _items(self.root)
            if _KEY.fullmatch(item.name) and item.is_dir() and self.is_ready(item.name)
        )

    def in_use(self) -> set[str]:
        """Keys a build is installing or linking right now: never removed."""
        with self._lock:
            return set(self._pending) | {key for key, n in self._users.items() if n > 0}

    @contextlib.contextmanager
    def use(self, key: str) -> Iterator[None]:
        """Hold ``key`` for a build: the collector leaves its entry alone meanwhile."""
        with self._lock:
            self._users[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._users[key] -= 1
                if self._users[key] <= 0:
                    del self._users[key]

    def remove(self, key: str) -> bool:
        """Delete the entry of ``key``; False when there was none.

        RuntimeError while a build holds it. The entry leaves its place in one
        rename, so nobody ever links from half of it.
        """
        target = self.path(key)
        with self._lock:
            if self._users.get(key) or key in self._pending:
                raise RuntimeError(f"dependencies {key} are in use by a build")
            self._ready.discard(key)
            if not target.exists():
                return False
            (target / DEPS_MARKER).unlink(missing_ok=True)
            doomed = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key}-rm-", dir=self.root))
            os.rename(target, doomed / key)
        _remove_path(doomed)
        return True

    def ensure(self, key: str, install: Callable[[Path], dict[str, Any]], wait_sec: float) -> bool:
        """Make the entry of ``key`` exist; True when this call installed it.

        ``install(folder)`` fills a fresh folder and returns what the marker
        records. A caller that finds another one installing the same key waits
        up to ``wait_sec`` (TimeoutError after) and gets its error if it failed.
        """
        if self.is_ready(key):
            return False
        with self._lock:
            pending = self._pending.get(key)
            owner = pending is None
            if pending is None:
                if self.is_ready(key):  # published since the check above
                    return False
                pending = self._pending[key] = _Pending()
        if not owner:
            if not pending.done.wait(max(wait_sec, 0)):
                raise TimeoutError(f"still installing dependencies {key} after {wait_sec:g} s")
            if pending.error is not None:
                raise pending.error
            return False
        try:
            self._install(key, install)
            return True
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            with self._lock:
                del self._pending[key]
            pending.done.set()

    def _install(self, key: str, install: Callable[[Path], dict[str, Any]]) -> None:
        final = self.path(key)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{key}-", dir=self.root))
        try:
            tmp.chmod(0o755)
            record = install(tmp)
            _make_read_only(tmp)
            if final.exists():  # unmarked: a crash between rename and marker
                _remove_path(final)
            os.rename(tmp, final)
        except BaseException:
            _remove_path(tmp)
            raise
        partial = final / f"{DEPS_MARKER}.partial"
        partial.write_text(json.dumps({**record, "key": key}, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, final / DEPS_MARKER)
        self._ready.add(key)

    def _remove_leftovers(self) -> None:
        # installs of a process that died, and entries renamed into place whose
        # marker was never written; the artifacts root belongs to one process
        for item in _items(self.root):
            temporary = item.name.startswith(TMP_PREFIX)
            unmarked = _KEY.fullmatch(item.name) and item.is_dir() and not self.is_ready(item.name)
            if temporary or unmarked:
                _remove_path(item)


def _items(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except FileNotFoundError:
        return []


def link_tree(source: Path, target: Path) -> None:
    """``cp -al source target``: folders made anew, files hard-linked, symlinks copied.

    Falls back to copying a file where a hard link is refused (another file
    system, a link count at its limit).
    """
    if not stat.S_ISDIR(os.lstat(source).st_mode):  # copytree would follow it
        raise NotADirectoryError(f"{source} is not a folder")
    shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EMLINK, errno.EPERM, errno.EACCES):
            raise
        shutil.copy2(source, target, follow_symlinks=False)


def _make_read_only(folder: Path) -> None:
    # files only: folders stay writable so that entries and artifacts can be deleted
    for parent, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(parent, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                os.chmod(path, stat.S_IMODE(mode) & ~0o222)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
