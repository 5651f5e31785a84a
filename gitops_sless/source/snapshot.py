"""Snapshots: one immutable view of a repository's files, from git objects or a directory.

A snapshot answers three questions: which entries a folder holds, what a blob
contains, and the git tree id of a folder. For a commit the answers come from
git objects (never a checkout). For a plain directory they are computed the
way git would, so the same content has the same tree id either way, and
symlinks are read as links, never followed.

``open_source`` is what ``validate`` and ``render`` read: the files on disk as
``git add --all`` would stage them (``.gitignore`` honoured), or a commit when a
ref is given. ``open_snapshot`` reads a repository at a commit (``HEAD`` by default).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pygit2

from ..errors import SourceError

__all__ = [
    "DirectorySnapshot",
    "Entry",
    "GitSnapshot",
    "Snapshot",
    "git_tree_id",
    "open_repository",
    "open_snapshot",
    "open_source",
]

Kind = Literal["tree", "blob", "link", "submodule"]

_MODE_KIND: dict[int, Kind] = {
    0o040000: "tree",
    0o100644: "blob",
    0o100755: "blob",
    0o120000: "link",
    0o160000: "submodule",
}


@dataclass(frozen=True)
class Entry:
    """One entry of a folder: a file, a folder, a symlink or a submodule."""

    name: str
    kind: Kind
    mode: int
    oid: str


class Snapshot:
    """The files of one revision. Paths are POSIX, relative, without a leading slash."""

    revision: str

    def entries(self, folder: str) -> list[Entry]:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        """Content of a blob, or the target of a symlink."""
        raise NotImplementedError

    def tree_id(self, folder: str) -> str:
        raise NotImplementedError

    def know(self, folder: str, tree_id: str) -> None:
        """``folder``'s tree id, found by whoever listed its parent: a snapshot that looks
        folders up by path may skip the walk."""

    def changed_since(self, other: Snapshot) -> dict[str, bool] | None:
        """Every file path that differs from ``other`` (added, removed, changed, or of
        another kind), with whether it exists here; None when this snapshot cannot tell
        without reading everything."""
        return None

    def walk(self, folder: str = "") -> Iterator[tuple[str, Entry]]:
        """Every entry below ``folder``, depth first, in git's order."""
        for entry in self.entries(folder):
            path = f"{folder}/{entry.name}" if folder else entry.name
            yield path, entry
            if entry.kind == "tree":
                yield from self.walk(path)


class GitSnapshot(Snapshot):
    """A commit of a pygit2 repository."""

    def __init__(self, repo: pygit2.Repository, commit: pygit2.Commit) -> None:
        self._repo = repo
        self.commit = commit
        self.revision = str(commit.id)
        # a commit never changes: every object found by path is kept (a path lookup
        # in libgit2 re-reads each tree on the way, which dominates big repositories)
        self._objects: dict[str, pygit2.Object] = {"": commit.tree}
        self._ids: dict[str, str] = {}  # folders whose tree id is known, not yet read

    def know(self, folder: str, tree_id: str) -> None:
        self._ids.setdefault(folder, tree_id)

    def _object(self, path: str) -> pygit2.Object:
        if path not in self._objects:
            if path in self._ids:  # by id: no path walk
                self._objects[path] = self._repo[self._ids[path]]
                return self._objects[path]
            folder, _, name = path.rpartition("/")
            try:
                if folder in self._objects or folder in self._ids:  # from its folder's tree
                    found = self._object(folder)[name]
                else:
                    found = self.commit.tree[path]
            except (KeyError, TypeError) as exc:  # TypeError: the folder is a file
                raise SourceError(f"{path}: not found in commit {self.revision[:12]}") from exc
            self._objects[path] = found
        return self._objects[path]

    def changed_since(self, other: Snapshot) -> dict[str, bool] | None:
        if not isinstance(other, GitSnapshot):
            return None
        try:  # libgit2 compares tree ids first: only the folders on the way are read
            old = self._repo[other.commit.tree.id]
        except KeyError:  # another repository's commit
            return None
        # renames are not detected: a moved file is one removed and one added
        return {
            delta.new_file.path: delta.status != pygit2.GIT_DELTA_DELETED
            for delta in old.diff_to_tree(self.commit.tree).deltas
        }

    def walk(self, folder: str = "") -> Iterator[tuple[str, Entry]]:
        tree = self._object(folder)
        if not isinstance(tree, pygit2.Tree):
            raise SourceError(f"{folder}: not a folder in commit {self.revision[:12]}")
        yield from self._walk_tree(tree, folder)

    def _walk_tree(self, tree: pygit2.Tree, folder: str) -> Iterator[tuple[str, Entry]]:
        for obj in tree:
            path = f"{folder}/{obj.name}" if folder else obj.name
            entry = _entry(obj)
            yield path, entry
            if entry.kind == "tree":
                self._objects[path] = obj
                yield from self._walk_tree(obj, path)

    def entries(self, folder: str) -> list[Entry]:
        tree = self._object(folder)
        if not isinstance(tree, pygit2.Tree):
            raise SourceError(f"{folder}: not a folder in commit {self.revision[:12]}")
        return [_entry(obj) for obj in tree]

    def read(self, path: str) -> bytes:
        obj = self._object(path)
        if not isinstance(obj, pygit2.Blob):
            raise SourceError(f"{path}: not a file in commit {self.revision[:12]}")
        return obj.data

    def tree_id(self, folder: str) -> str:
        if folder in self._ids:
            return self._ids[folder]
        return str(self._object(folder).id)


def _entry(obj: pygit2.Object) -> Entry:
    # a folder needs no file mode (pygit2 makes an enum of each: a cost at 10,000 folders)
    if obj.type_str == "tree":
        return Entry(obj.name, "tree", 0o040000, str(obj.id))
    mode = int(obj.filemode)
    return Entry(obj.name, _MODE_KIND.get(mode, "blob"), mode, str(obj.id))


SKIPPED = frozenset({".git", "__pycache__", "node_modules", ".sless-deps"})


@dataclass
class _DirNode:
    entries: dict[str, Entry] = field(default_factory=dict)
    children: dict[str, _DirNode] = field(default_factory=dict)
    oid: str = ""


def _git_hash(kind: str, body: bytes) -> str:
    return hashlib.sha1(b"%s %d\0%s" % (kind.encode(), len(body), body)).hexdigest()


def _tree_sort_key(entry: Entry) -> bytes:
    # git orders a folder as if its name ended with "/"
    name = os.fsencode(entry.name)
    return name + b"/" if entry.kind == "tree" else name


def git_tree_id(entries: list[Entry]) -> str:
    """The id git gives a tree holding exactly these entries."""
    body = b"".join(
        b"%o %s\0%s" % (e.mode, os.fsencode(e.name), bytes.fromhex(e.oid))
        for e in sorted(entries, key=_tree_sort_key)
    )
    return _git_hash("tree", body)


class _GitIgnore:
    """git's ignore rules for the files below one folder, as libgit2 applies them.

    In a git work tree (``folder`` may be any folder of it) the rules are every
    ``.gitignore`` of the work tree, ``.git/info/exclude`` and ``core.excludesFile``;
    files in the index are never ignored, as in git. A folder outside any work tree
    is read through a repository without a git folder whose work dir is ``folder``:
    its own ``.gitignore`` files and ``core.excludesFile`` apply, as they would
    after ``git init``.
    """

    def __init__(self, folder: Path) -> None:
        repo = _enclosing_work_tree(folder)
        self.tracked: frozenset[str] = frozenset()
        self.tracked_dirs: frozenset[str] = frozenset()
        if repo is None:
            self.work_tree: Path | None = None
            self._prefix = ""
            # libgit2 reads ignore rules from the work dir and the config only; with no
            # git folder there is no info/exclude, as for a folder git has never seen
            repo = pygit2.Repository()
            repo.workdir = str(folder)
        else:
            self.work_tree = Path(repo.workdir).resolve()
            rel = folder.relative_to(self.work_tree).as_posix()
            self._prefix = "" if rel == "." else f"{rel}/"
            self._read_index(repo)
        self._repo = repo

    def _read_index(self, repo: pygit2.Repository) -> None:
        try:
            paths = [entry.path for entry in repo.index]
        except (pygit2.GitError, OSError, UnicodeError):
            return  # an unreadable index: ignore rules alone decide
        tracked, dirs = set(), set()
        for path in paths:
            if not path.startswith(self._prefix):
                continue
            rel = path[len(self._prefix) :]
            tracked.add(rel)
            parent = rel.rpartition("/")[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rpartition("/")[0]
        self.tracked, self.tracked_dirs = frozenset(tracked), frozenset(dirs)

    def ignored(self, rel: str) -> bool:
        """Whether git ignores ``rel`` (relative to the folder) if it is not tracked."""
        # libgit2 takes UTF-8 only: a byte that is not UTF-8 is matched as one unknown
        # character (wildcards match it, a literal never does). libgit2 also follows a
        # symlink to tell whether the path is a folder, so a link to a folder matches
        # "name/" patterns where git would keep it: the one known difference from git.
        path = (self._prefix + rel).encode("utf-8", "replace").decode("utf-8")
        return self._repo.path_is_ignored(path)


def _submodule(path: Path, name: str) -> Entry | None:
    """A folder holding a repository, as ``git add`` stages it: a link to its ``HEAD``."""
    try:
        head = pygit2.Repository(str(path)).head.target
    except (pygit2.GitError, KeyError):
        return None  # no commit checked out: git refuses to add it
    return Entry(name, "submodule", 0o160000, str(head))


def _enclosing_work_tree(folder: Path) -> pygit2.Repository | None:
    """The repository whose work tree holds ``folder`` (its root or any folder below)."""
    try:
        found = pygit2.discover_repository(str(folder))
        repo = pygit2.Repository(found) if found else None
    except pygit2.GitError:
        return None
    if repo is None or repo.is_bare or not repo.workdir:
        return None
    try:
        rel = folder.relative_to(Path(repo.workdir).resolve())
    except ValueError:
        return None
    return None if ".git" in rel.parts else repo


class DirectorySnapshot(Snapshot):
    """A plain directory, hashed as git would hash it once committed.

    Empty folders are left out (git cannot hold them), as are ``.git`` and the
    build outputs a local run leaves behind (``SKIPPED``); sockets and devices
    are ignored, and symlinks are never followed.

    With ``gitignore=True`` the directory is read as ``git add --all`` would stage
    it: files git ignores are left out (tracked files never are, as in git), and a
    folder holding its own repository is a submodule entry at that repository's
    ``HEAD`` (left out when it has no commit). ``work_tree`` is then the root of the
    git work tree holding the directory, or ``None`` outside of one.
    """

    def __init__(self, root: Path, *, gitignore: bool = False) -> None:
        self.root = root.resolve()
        if not self.root.is_dir():
            raise SourceError(f"{root}: not a directory")
        self._ignore = _GitIgnore(self.root) if gitignore else None
        self.work_tree = self._ignore.work_tree if self._ignore else None
        self._tree = self._scan(self.root, "", False)
        self.revision = f"dir:{self._tree.oid}"

    def _scan(self, folder: Path, rel: str, in_ignored: bool) -> _DirNode:
        """``in_ignored``: ``folder`` is ignored, only its tracked files are kept."""
        node = _DirNode()
        with os.scandir(folder) as it:
            for item in it:
                path = f"{rel}/{item.name}" if rel else item.name
                entry, child = self._scan_item(Path(item.path), item.name, path, in_ignored)
                if entry is None:
                    continue
                node.entries[item.name] = entry
                if child is not None:
                    node.children[item.name] = child
        node.oid = git_tree_id(list(node.entries.values()))
        return node

    def _scan_item(
        self, path: Path, name: str, rel: str, in_ignored: bool
    ) -> tuple[Entry | None, _DirNode | None]:
        st = path.lstat()
        is_dir = stat.S_ISDIR(st.st_mode)
        if is_dir and name in SKIPPED:
            return None, None
        ignore = self._ignore
        if ignore is not None:
            # a path in the index is never ignored (a folder: when it holds tracked files)
            tracked = rel in ignore.tracked or (is_dir and rel in ignore.tracked_dirs)
            in_ignored = in_ignored or ignore.ignored(rel)
            if in_ignored and not tracked:
                return None, None
            if is_dir and os.path.lexists(path / ".git"):
                return _submodule(path, name), None
            # below an ignored folder that holds tracked files, only those files count
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path).encode()
            return Entry(name, "link", 0o120000, _git_hash("blob", target)), None
        if is_dir:
            child = self._scan(path, rel, in_ignored)
            if not child.entries:
                return None, None
            return Entry(name, "tree", 0o040000, child.oid), child
        if stat.S_ISREG(st.st_mode):
            mode = 0o100755 if st.st_mode & stat.S_IXUSR else 0o100644
            return Entry(name, "blob", mode, _git_hash("blob", path.read_bytes())), None
        return None, None

    def _node(self, folder: str) -> _DirNode:
        node = self._tree
        for part in filter(None, folder.split("/")):
            if part not in node.children:
                raise SourceError(f"{folder}: not a folder in {self.root}")
            node = node.children[part]
        return node

    def entries(self, folder: str) -> list[Entry]:
        return sorted(self._node(folder).entries.values(), key=_tree_sort_key)

    def read(self, path: str) -> bytes:
        parent, _, name = path.rpartition("/")
        entry = self._node(parent).entries.get(name)
        if entry is None or entry.kind not in ("blob", "link"):
            raise SourceError(f"{path}: not a file in {self.root}")
        if entry.kind == "link":
            return os.readlink(self.root / path).encode()
        return (self.root / path).read_bytes()

    def tree_id(self, folder: str) -> str:
        return self._node(folder).oid


def open_repository(path: Path) -> pygit2.Repository | None:
    """The repository whose root (work tree or bare folder) is exactly ``path``, if any."""
    if not path.is_dir():
        return None
    try:
        found = pygit2.discover_repository(str(path))
        repo = pygit2.Repository(found) if found else None
    except pygit2.GitError:
        return None
    if repo is None:
        return None
    root = Path(repo.workdir if repo.workdir else repo.path).resolve()
    return repo if root == path.resolve() else None


def open_snapshot(path: str | Path, ref: str | None = None) -> Snapshot:
    """A snapshot of ``path``: a commit when it is a repository root, else the directory.

    ``ref`` (a branch, tag or commit id) requires a repository; without it a
    repository is read at ``HEAD``.
    """
    path = Path(path)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    repo = open_repository(path)
    if repo is None:
        if ref is not None:
            raise SourceError(f"{path}: --ref {ref} given, but this is not a git repository")
        return DirectorySnapshot(path)
    try:
        commit = repo.revparse_single(ref or "HEAD").peel(pygit2.Commit)
    except (KeyError, pygit2.GitError, ValueError) as exc:
        raise SourceError(f"{path}: cannot resolve {ref or 'HEAD'} to a commit") from exc
    return GitSnapshot(repo, commit)


def open_source(path: str | Path, ref: str | None = None) -> Snapshot:
    """What ``validate`` and ``render`` read at ``path``.

    Without ``ref``: the files on disk, as ``git add --all`` would stage them
    (``DirectorySnapshot(gitignore=True)``), in a git work tree (its root or any
    folder of it) or a plain directory alike; a bare repository has no files on
    disk and is read at ``HEAD``. With ``ref``: that commit of the repository
    whose root is ``path``.
    """
    path = Path(path)
    if not path.exists():
        raise SourceError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise SourceError(f"{path}: not a directory")
    repo = open_repository(path)
    if ref is None:
        if repo is not None and repo.is_bare:
            return open_snapshot(path)
        return DirectorySnapshot(path, gitignore=True)
    if repo is None:
        work_tree = _enclosing_work_tree(path.resolve())
        if work_tree is not None:
            root = Path(work_tree.workdir).resolve()
            raise SourceError(
                f"{path}: --ref {ref} reads a whole commit; give the root of the git work "
                f"tree, {root}, not a folder inside it"
            )
    return open_snapshot(path, ref)
