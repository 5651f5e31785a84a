"""Snapshots: a directory hashes exactly as git would; links are read, never followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gitops_sless.errors import SourceError
from gitops_sless.source import DirectorySnapshot, GitSnapshot, open_snapshot

from .gitserver import git


def _git(repo: Path, *args: str) -> str:
    return git(*args, cwd=repo)


def _tricky_tree(root: Path) -> None:
    # names whose order differs between plain sorting and git's folder-as-"name/" rule
    for rel, text in {
        "a.b": "1",
        "a/x": "2",
        "a-b/y": "3",
        "a0": "4",
        "dir/sub/deep.txt": "5",
        "ünïcode.txt": "6",
        "exec.sh": "#!/bin/sh\n",
    }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    os.chmod(root / "exec.sh", 0o755)
    os.symlink("a/x", root / "link")
    (root / "empty").mkdir()  # git cannot hold empty folders: left out


def test_directory_tree_ids_equal_gits(tmp_path):
    _tricky_tree(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    assert DirectorySnapshot(tmp_path).tree_id("") == _git(tmp_path, "write-tree")
    _git(tmp_path, "commit", "-qm", "x")
    assert DirectorySnapshot(tmp_path).tree_id("dir") == _git(tmp_path, "rev-parse", "HEAD:dir")
    snapshot = open_snapshot(tmp_path)
    assert isinstance(snapshot, GitSnapshot)
    assert snapshot.tree_id("a") == DirectorySnapshot(tmp_path).tree_id("a")


def test_directory_and_commit_list_the_same_entries(tmp_path):
    _tricky_tree(tmp_path)
    directory = list(DirectorySnapshot(tmp_path).walk())
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "x")
    assert list(open_snapshot(tmp_path).walk()) == directory


def test_symlinks_are_read_not_followed(tmp_path):
    secret = tmp_path / "outside.txt"
    secret.write_text("top secret")
    repo = tmp_path / "repo"
    repo.mkdir()
    os.symlink(secret, repo / "abs-link")
    os.symlink("../outside.txt", repo / "rel-link")
    snapshot = DirectorySnapshot(repo)
    assert snapshot.read("abs-link") == str(secret).encode()
    assert snapshot.read("rel-link") == b"../outside.txt"
    kinds = {path: entry.kind for path, entry in snapshot.walk()}
    assert kinds == {"abs-link": "link", "rel-link": "link"}


def test_build_outputs_are_not_source(tmp_path):
    (tmp_path / "h.py").write_text("x")
    before = DirectorySnapshot(tmp_path).tree_id("")
    for junk in ("__pycache__/h.pyc", "node_modules/m/index.js", ".sless-deps/p.py"):
        (tmp_path / junk).parent.mkdir(parents=True)
        (tmp_path / junk).write_text("junk")
    assert DirectorySnapshot(tmp_path).tree_id("") == before


def test_unreadable_sources_are_clear_errors(tmp_path):
    with pytest.raises(SourceError, match="no such file or directory"):
        open_snapshot(tmp_path / "missing")
    (tmp_path / "f").write_text("x")
    with pytest.raises(SourceError, match="not a directory"):
        open_snapshot(tmp_path / "f")
    with pytest.raises(SourceError, match="not a git repository"):
        open_snapshot(tmp_path, ref="main")


def test_a_subfolder_of_a_work_tree_is_read_as_a_directory(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub/f").write_text("uncommitted")
    snapshot = open_snapshot(tmp_path / "sub")
    assert isinstance(snapshot, DirectorySnapshot)
    assert snapshot.read("f") == b"uncommitted"


def test_bare_repository_and_refs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    _git(work, "init", "-q", "-b", "main")
    (work / "f").write_text("one")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "1")
    first = _git(work, "rev-parse", "HEAD")
    (work / "f").write_text("two")
    _git(work, "commit", "-qam", "2")
    _git(tmp_path, "clone", "-q", "--bare", str(work), "bare.git")
    bare = open_snapshot(tmp_path / "bare.git")
    assert bare.read("f") == b"two"
    old = open_snapshot(tmp_path / "bare.git", ref=first)
    assert old.revision == first and old.read("f") == b"one"


def test_a_file_name_that_is_not_utf8_hashes_as_git_does(tmp_path):
    (tmp_path / "ok.txt").write_text("x")
    with open(os.path.join(os.fsencode(tmp_path), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin-1 name")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    assert DirectorySnapshot(tmp_path).tree_id("") == _git(tmp_path, "write-tree")
