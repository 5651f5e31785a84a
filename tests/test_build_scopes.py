"""Build records are kept per tag and trust scope: a fork's failed build never holds back prod.

A tag names a tree, so a fork's pull request can carry the very tree prod is about to
build. Its build runs in the untrusted scope (``Backend.for_untrusted``) and may fail
there for reasons of its own; that failure is the fork's, and prod, which shares the
status store with every preview, builds the tag all the same. On the local backend,
with real pip installs and one store, as ``serve`` has them (on Kubernetes:
tests/kube/test_kube_builds_isolation.py).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gitops_sless.local.backend import LocalBackend
from gitops_sless.local.secrets import SecretsDir
from gitops_sless.reconciler import Reconciler
from gitops_sless.source.snapshot import DirectorySnapshot
from gitops_sless.state.inflight import InFlight
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store

from .kube.test_kube_backend import wait_for
from .local.test_local_builder import WHEEL_NAME, make_wheel

HANDLER = "import sless_tinypkg\n\ndef main(event):\n    return {'answer': sless_tinypkg.ANSWER}\n"


class FolderSource:
    """A function repository as a plain folder (no git server needed for this)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fetch(self) -> None:
        return None

    def snapshot(self, commit: str | None = None) -> DirectorySnapshot:
        return DirectorySnapshot(self.path)


def phase(reconciler: Reconciler, name: str) -> str | None:
    reconciler.sync("test")
    record = reconciler.store.function(reconciler.env, name)
    return record["phase"] if record else None


def test_a_forks_failed_build_of_a_tree_never_holds_back_prods_build_of_it(tmp_path):
    # the team's package index: the fork's build runs while it does not have the package yet
    index = tmp_path / "index"
    index.mkdir()
    repo = tmp_path / "repo"
    (repo / "greet").mkdir(parents=True)
    (repo / "greet" / "sless.yaml").write_text(
        "functions:\n"
        "  - name: greet\n"
        "    runtime: python3.11\n"
        "    entrypoint: handler.main\n"
        "    triggers: [{type: http}]\n"
    )
    (repo / "greet" / "handler.py").write_text(HANDLER)
    (repo / "greet" / "requirements.txt").write_text(
        f"--no-index\n--find-links {index}\nsless-tinypkg==1.0\n"
    )
    routes, store, work = RouteTable(), Store(tmp_path / "state" / "status.db"), InFlight(16)
    backend = LocalBackend(tmp_path / "state", routes, SecretsDir(None))
    source = FolderSource(repo)  # the fork's tree is byte for byte what prod builds
    fork = Reconciler(source, backend.for_untrusted(), store, env="pr-7", routes=routes, work=work)
    prod = Reconciler(source, backend, store, env="prod", routes=routes, work=work)
    try:
        wait_for(lambda: phase(fork, "greet") == "Failed", "the fork's build to fail", 120)
        tag = store.function("pr-7", "greet")["wanted_tag"]
        assert "pip install exited 1" in store.function("pr-7", "greet")["message"]
        (index / WHEEL_NAME).write_bytes(make_wheel())  # the package is there now
        # prod wants the tag within build_retry_sec of the fork's failure: it builds it
        wait_for(lambda: phase(prod, "greet") in ("Ready", "Failed"), "prod's build to end", 120)
        served = store.function("prod", "greet")
        assert served["phase"] == "Ready", served["message"]
        assert store.build(tag, "")["phase"] == "Succeeded"
        assert store.build(tag, "untrusted")["phase"] == "Failed"
        assert store.function("prod", "greet")["build_tag"] == tag
        assert routes.get("prod", "greet") is not None
    finally:
        fork.stop()
        prod.stop()
        work.shutdown()
        backend.close()
        store.close()


def test_builds_recorded_before_trust_scopes_are_kept_as_the_trusted_scopes(tmp_path):
    """A state folder from an earlier release: builds keyed by tag alone still read back."""
    path = tmp_path / "status.db"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE builds (tag TEXT PRIMARY KEY, runtime TEXT NOT NULL, source_id TEXT "
            "NOT NULL, phase TEXT NOT NULL, started REAL NOT NULL, finished REAL, log TEXT NOT "
            "NULL DEFAULT '', error TEXT, folder TEXT NOT NULL DEFAULT '')"
        )
        db.execute(
            "INSERT INTO builds VALUES ('python3.11-aa', 'python3.11', 'aa', 'Succeeded', 1.0,"
            " 2.0, 'built it', NULL, 'greet')"
        )
    store = Store(path)
    try:
        old = store.build("python3.11-aa", "")
        assert old is not None
        assert (old["phase"], old["log"], old["folder"], old["image"]) == (
            "Succeeded",
            "built it",
            "greet",
            None,
        )
        assert store.build("python3.11-aa") == old
        assert store.build("python3.11-aa", "untrusted") is None
        # and the table now holds one row per scope
        store.start_build("python3.11-aa", "python3.11", "aa", "greet", "untrusted")
        store.finish_build("python3.11-aa", "Failed", "no", "build failed", scope="untrusted")
        assert store.build("python3.11-aa", "")["phase"] == "Succeeded"
        assert store.build("python3.11-aa")["phase"] == "Succeeded"  # readers see the trusted
        store.delete_builds(["python3.11-aa"])
        assert store.build("python3.11-aa") is None
    finally:
        store.close()
    Store(path).close()  # opening it again migrates nothing twice
