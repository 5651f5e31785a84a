"""Snapshots: one immutable view of a repository's files, from git objects or a directory.

A snapshot answers three questions: which entries a folder holds, what a blob
contains, and the git tree id of a folder. For a commit the answers come from
git objects (never a checkout). For a plain directory they are computed the
way git would, so the same content has the same tree id either way, and
symlinks are read as links, never followed.
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

from .errors import SourceError

__all__ = [
    "DirectorySnapshot",
    "Entry",
    "GitSnapshot",
    "Snapshot",
    "git_tree_id",
    "open_repository",
    "open_snapshot",
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

    def _object(self, path: str) -> pygit2.Object:
        if path not in self._objects:
            try:
                self._objects[path] = self.commit.tree[path]
            except KeyError as exc:
                raise SourceError(f"{path}: not found in commit {self.revision[:12]}") from exc
        return self._objects[path]

    def walk(self, folder: str = "") -> Iterator[tuple[str, Entry]]:
        tree = self._object(folder)
        if not isinstance(tree, pygit2.Tree):
            raise SourceError(f"{folder}: not a folder in commit {self.revision[:12]}")
        yield from self._walk_tree(tree, folder)

    def _walk_tree(self, tree: pygit2.Tree, folder: str) -> Iterator[tuple[str, Entry]]:
        for obj in tree:
            path = f"{folder}/{obj.name}" if folder else obj.name
            kind = _MODE_KIND.get(obj.filemode, "blob")
            yield path, Entry(obj.name, kind, obj.filemode, str(obj.id))
            if kind == "tree":
                self._objects[path] = obj
                yield from self._walk_tree(obj, path)

    def entries(self, folder: str) -> list[Entry]:
        tree = self._object(folder)
        if not isinstance(tree, pygit2.Tree):
            raise SourceError(f"{folder}: not a folder in commit {self.revision[:12]}")
        return [
            Entry(obj.name, _MODE_KIND.get(obj.filemode, "blob"), obj.filemode, str(obj.id))
            for obj in tree
        ]

    def read(self, path: str) -> bytes:
        obj = self._object(path)
        if not isinstance(obj, pygit2.Blob):
            raise SourceError(f"{path}: not a file in commit {self.revision[:12]}")
        return obj.data

    def tree_id(self, folder: str) -> str:
        return str(self._object(folder).id)


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


class DirectorySnapshot(Snapshot):
    """A plain directory, hashed as git would hash it once committed.

    Empty folders are left out (git cannot hold them), as are ``.git`` and the
    build outputs a local run leaves behind (``SKIPPED``); sockets and devices
    are ignored, and symlinks are never followed.
    """

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        if not self.root.is_dir():
            raise SourceError(f"{root}: not a directory")
        self._tree = self._scan(self.root)
        self.revision = f"dir:{self._tree.oid}"

    def _scan(self, folder: Path) -> _DirNode:
        node = _DirNode()
        with os.scandir(folder) as it:
            for item in it:
                entry, child = self._scan_item(Path(item.path), item.name)
                if entry is None:
                    continue
                node.entries[item.name] = entry
                if child is not None:
                    node.children[item.name] = child
        node.oid = git_tree_id(list(node.entries.values()))
        return node

    def _scan_item(self, path: Path, name: str) -> tuple[Entry | None, _DirNode | None]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path).encode()
            return Entry(name, "link", 0o120000, _git_hash("blob", target)), None
        if stat.S_ISDIR(st.st_mode):
            if name in SKIPPED:
                return None, None
            child = self._scan(path)
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
