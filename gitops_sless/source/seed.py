"""Seeding: a plain directory becomes a bare repository that ``serve`` follows.

This is how ``serve --repo sample-repo`` works on a folder that is not a git
repository: its files are committed once into a bare repository the user can
clone and push to, and the mirror follows that.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pygit2

from ..errors import SourceError
from .snapshot import DirectorySnapshot, open_repository

__all__ = ["SEED_SIGNATURE", "is_repository", "seed_repository"]

log = logging.getLogger(__name__)

SEED_SIGNATURE = ("gitops-sless", "gitops-sless@localhost")


def is_repository(path: Path) -> bool:
    """Whether ``path`` is the root of a work tree or of a bare repository."""
    return open_repository(Path(path)) is not None


def seed_repository(directory: Path, bare: Path, branch: str = "main") -> Path:
    """A bare repository at ``bare`` holding one commit with the files of ``directory``.

    An existing ``bare`` is returned untouched: pushes made since the first run are
    the truth now. Files are read as ``DirectorySnapshot`` reads them (skipped folders
    left out, exec bits kept, symlinks stored as links and never followed).
    """
    bare = Path(bare)
    if is_repository(bare):
        return bare
    if bare.exists() and (not bare.is_dir() or any(bare.iterdir())):
        raise SourceError(f"{bare}: exists and is not a git repository")
    snapshot = DirectorySnapshot(Path(directory))
    # built beside the target and renamed into place: a crash never leaves half a repository
    bare.parent.mkdir(parents=True, exist_ok=True)
    staging = bare.parent / f".{bare.name}.seeding-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        commit = _seed_commit(snapshot, staging, branch)
        os.replace(staging, bare)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("seeded %s from %s (branch %s at %s)", bare, directory, branch, commit[:12])
    return bare


def _seed_commit(snapshot: DirectorySnapshot, path: Path, branch: str) -> str:
    repo = pygit2.init_repository(str(path), bare=True, initial_head=branch)
    tree = _write_tree(repo, snapshot, "")
    signature = pygit2.Signature(*SEED_SIGNATURE)
    message = f"Import {snapshot.root.name} (seeded by gitops-sless)\n"
    commit = repo.create_commit(f"refs/heads/{branch}", signature, signature, message, tree, [])
    return str(commit)


def _write_tree(repo: pygit2.Repository, snapshot: DirectorySnapshot, folder: str) -> pygit2.Oid:
    builder = repo.TreeBuilder()
    for entry in snapshot.entries(folder):
        if entry.name == ".git":
            continue  # a gitfile; git refuses the name in a tree
        path = f"{folder}/{entry.name}" if folder else entry.name
        if entry.kind == "tree":
            oid = _write_tree(repo, snapshot, path)
        else:
            oid = repo.create_blob(snapshot.read(path))
        builder.insert(entry.name, oid, entry.mode)
    return builder.write()
