"""Snapshots: a directory hashes exactly as git would; links are read, never followed."""

from __future__ import annotations

import os
from pathlib import Path

import pygit2
import pytest

from gitops_sless.errors import SourceError
from gitops_sless.source.snapshot import DirectorySnapshot, GitSnapshot, open_snapshot, open_source

from ..gitserver import git


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


@pytest.fixture
def no_user_git_config(tmp_path_factory):
    """libgit2 in this process reads no user or system git config (core.excludesFile):
    the ``git`` the tests compare with runs without them too."""
    from pygit2.enums import ConfigLevel

    empty = str(tmp_path_factory.mktemp("no-git-config"))
    levels = (ConfigLevel.GLOBAL, ConfigLevel.XDG, ConfigLevel.SYSTEM)
    saved = {level: pygit2.settings.search_path[level] for level in levels}
    for level in levels:
        pygit2.settings.search_path[level] = empty
    yield
    for level, path in saved.items():
        pygit2.settings.search_path[level] = path


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _staged_tree(root: Path) -> str:
    """The tree ``git add --all`` stages: what the snapshot must hash to."""
    _git(root, "add", "--all")
    return _git(root, "write-tree")


def test_work_tree_is_read_as_git_add_would_stage_it(tmp_path, no_user_git_config):
    _git(tmp_path, "init", "-q")
    _write(
        tmp_path,
        {
            ".gitignore": "*.log\n!keep.log\nbuild/\n/secret.txt\n",
            "fn/.gitignore": "*.tmp\n!important.tmp\n",
            "fn/deeper/.gitignore": "!*.log\n",
            "fn/handler.py": "committed\n",
            "build/forced.txt": "tracked although its folder is ignored\n",
            "forced.log": "tracked although ignored\n",
        },
    )
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "add", "-f", "build/forced.txt", "forced.log")
    _git(tmp_path, "commit", "-qm", "first")
    (tmp_path / ".git/info/exclude").write_text("local-only/\n")
    _write(
        tmp_path,
        {
            "fn/handler.py": "changed, not committed\n",
            "fn/new.py": "untracked\n",
            "a.log": "ignored",
            "keep.log": "negated: kept",
            "build/out.bin": "ignored folder",
            "build/forced.txt": "tracked, changed",
            "forced.log": "tracked, changed",
            "secret.txt": "anchored: ignored at the root only",
            "fn/secret.txt": "kept",
            "fn/x.tmp": "ignored by the nested .gitignore",
            "fn/important.tmp": "negated: kept",
            "fn/deeper/y.log": "re-included by a deeper .gitignore",
            "local-only/f": "ignored by .git/info/exclude",
        },
    )
    snapshot = DirectorySnapshot(tmp_path, gitignore=True)
    paths = {path for path, entry in snapshot.walk() if entry.kind == "blob"}
    assert paths == {
        ".gitignore",
        "build/forced.txt",
        "fn/.gitignore",
        "fn/deeper/.gitignore",
        "fn/deeper/y.log",
        "fn/handler.py",
        "fn/important.tmp",
        "fn/new.py",
        "fn/secret.txt",
        "forced.log",
        "keep.log",
    }
    assert snapshot.work_tree == tmp_path.resolve()
    assert snapshot.read("fn/handler.py") == b"changed, not committed\n"
    with pytest.raises(SourceError):
        snapshot.read("a.log")
    assert snapshot.tree_id("") == _staged_tree(tmp_path)


def test_a_folder_of_a_work_tree_takes_the_rules_of_the_whole_work_tree(
    tmp_path, no_user_git_config
):
    _git(tmp_path, "init", "-q")
    _write(tmp_path, {".gitignore": "*.log\n", "sub/f.txt": "x", "sub/debug.log": "ignored"})
    (tmp_path / ".git/info/exclude").write_text("sub/local.txt\n")
    (tmp_path / "sub/local.txt").write_text("ignored")
    snapshot = open_source(tmp_path / "sub")
    assert isinstance(snapshot, DirectorySnapshot)
    assert [path for path, _ in snapshot.walk()] == ["f.txt"]
    assert snapshot.work_tree == tmp_path.resolve()
    staged = _staged_tree(tmp_path)
    assert snapshot.tree_id("") == _git(tmp_path, "rev-parse", f"{staged}:sub")


def test_a_plain_folder_honours_its_gitignore_files(tmp_path, no_user_git_config):
    _write(
        tmp_path,
        {
            ".gitignore": "*.log\n!keep.log\ndrafts/\n",
            "keep.log": "kept",
            "a.log": "ignored",
            "drafts/sless.yaml": "ignored folder",
            "fn/.gitignore": "*.js\n!main.js\n",
            "fn/main.js": "kept",
            "fn/other.js": "ignored",
        },
    )
    with open(os.path.join(os.fsencode(tmp_path), b"caf\xe9.log"), "wb") as f:
        f.write(b"a name that is not UTF-8, ignored by *.log")
    with open(os.path.join(os.fsencode(tmp_path), b"caf\xe9.txt"), "wb") as f:
        f.write(b"a name that is not UTF-8, kept")
    snapshot = open_source(tmp_path)
    assert isinstance(snapshot, DirectorySnapshot) and snapshot.work_tree is None
    names = {path for path, _ in snapshot.walk()}
    assert {"keep.log", "fn/main.js"} <= names
    assert not names & {"a.log", "drafts", "fn/other.js", os.fsdecode(b"caf\xe9.log")}
    # the same folder once it is a repository: git stages exactly the same tree
    _git(tmp_path, "init", "-q")
    assert snapshot.tree_id("") == _staged_tree(tmp_path)


def test_a_nested_repository_is_a_submodule_as_git_would_stage_it(tmp_path, no_user_git_config):
    outer, inner = tmp_path / "outer", tmp_path / "outer/fn/vendor"
    _write(outer, {"fn/h.py": "x"})
    _git(outer, "init", "-q")
    _write(inner, {"lib.py": "y"})
    _git(inner, "init", "-q")
    _git(inner, "add", "-A")
    _git(inner, "commit", "-qm", "inner")
    snapshot = DirectorySnapshot(outer, gitignore=True)
    vendor = {e.name: e for e in snapshot.entries("fn")}["vendor"]
    assert (vendor.kind, vendor.oid) == ("submodule", _git(inner, "rev-parse", "HEAD"))
    assert snapshot.tree_id("") == _staged_tree(outer)


def test_open_source_reads_disk_unless_a_ref_is_given(tmp_path):
    repo = tmp_path / "repo"
    _write(repo, {"f": "committed"})
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "1")
    (repo / "f").write_text("on disk")
    assert open_source(repo).read("f") == b"on disk"
    at_head = open_source(repo, "HEAD")
    assert isinstance(at_head, GitSnapshot) and at_head.read("f") == b"committed"
    (repo / "sub").mkdir()
    (repo / "sub/g").write_text("x")
    with pytest.raises(SourceError, match=r"give the root of the git work tree, .*repo"):
        open_source(repo / "sub", "HEAD")
    with pytest.raises(SourceError, match="not a git repository"):
        open_source(tmp_path / "repo/sub/../..", "HEAD")
    _git(tmp_path, "clone", "-q", "--bare", str(repo), "bare.git")
    bare = open_source(tmp_path / "bare.git")  # no files on disk: HEAD
    assert isinstance(bare, GitSnapshot) and bare.read("f") == b"committed"
