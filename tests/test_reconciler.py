"""The reconcile loop in process: which pass serves a sync request."""

from __future__ import annotations

import threading

from gitops_sless.local.backend import LocalBackend
from gitops_sless.local.secrets import SecretsDir
from gitops_sless.reconciler import Reconciler
from gitops_sless.source.snapshot import DirectorySnapshot
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store


class GatedSource:
    """A source whose fetch waits for the test to open the gate."""

    def __init__(self, snapshot: DirectorySnapshot) -> None:
        self._snapshot = snapshot
        self.gate = threading.Event()
        self.fetching = threading.Event()

    def fetch(self) -> None:
        self.fetching.set()
        assert self.gate.wait(20)

    def snapshot(self, commit: str | None = None) -> DirectorySnapshot:
        return self._snapshot


def test_a_request_during_a_pass_that_already_fetched_waits_for_the_next_one(tmp_path):
    (tmp_path / "repo").mkdir()
    source = GatedSource(DirectorySnapshot(tmp_path / "repo"))
    backend = LocalBackend(tmp_path / "state", RouteTable(), SecretsDir(None))
    reconciler = Reconciler(source, backend, Store(tmp_path / "state" / "status.db"))
    loop = threading.Thread(target=reconciler.run_forever, daemon=True)
    loop.start()
    try:
        assert reconciler.request_sync("first") == 1
        assert source.fetching.wait(10)
        # the running pass fetched before this request: only the pass after it serves it
        assert reconciler.request_sync("second") == 2
        assert not reconciler.wait_for_pass(1, 0.2)
        source.gate.set()
        assert reconciler.wait_for_pass(1, 20)
        assert [s["trigger"] for s in reconciler.store.syncs()][-1] == "first"
        assert reconciler.passes == 2
    finally:
        source.gate.set()
        reconciler.stop()
        backend.close()
