"""A kubeconfig whose exec plugin issues expiring tokens keeps working, as with kubectl.

The plugin is a real program the client runs (a script printing an ExecCredential
with a token and its ``expirationTimestamp``, counting its runs); the test API
server takes only the tokens it issued that have not run out or been revoked,
and answers 401 to any other, as a real one does.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gitops_sless.kube.client import Forbidden, KubeClient

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, kube_env
from ..kubeapi import FakeKube
from ..paths import SAMPLE
from ..sless_server import SlessServer

PLUGIN = textwrap.dedent(
    """\
    import json, sys, time
    from datetime import datetime, timezone
    from pathlib import Path

    issued, lifetime = Path(sys.argv[1]), float(sys.argv[2])
    lines = issued.read_text().splitlines() if issued.exists() else []
    token, expiry = f"tok-{len(lines) + 1}", time.time() + lifetime
    with issued.open("a") as out:
        out.write(f"{token} {expiry}\\n")
    stamp = datetime.fromtimestamp(expiry, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(json.dumps({
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "kind": "ExecCredential",
        "status": {"token": token, "expirationTimestamp": stamp},
    }))
    """
)


class Issuer:
    """The exec plugin's tokens, as the API server sees them: issued, expiring, revocable."""

    def __init__(self, tmp_path: Path, lifetime_sec: float) -> None:
        self.plugin = tmp_path / "token-plugin.py"
        self.plugin.write_text(PLUGIN)
        self.issued = tmp_path / "issued-tokens"
        self.lifetime_sec = lifetime_sec
        self.revoked: set[str] = set()
        self.seen: list[str] = []
        self.refused = 0
        self._lock = threading.Lock()

    def tokens(self) -> dict[str, float]:
        if not self.issued.exists():
            return {}
        pairs = (line.split() for line in self.issued.read_text().splitlines())
        return {token: float(expiry) for token, expiry in pairs}

    def authenticate(self, authorization: str | None) -> bool:
        token = (authorization or "").removeprefix("Bearer ")
        expiry = self.tokens().get(token)
        ok = expiry is not None and expiry > time.time() and token not in self.revoked
        with self._lock:
            self.seen.append(token)
            self.refused += not ok
        return ok

    def revoke_all(self) -> None:
        self.revoked.update(self.tokens())

    def kubeconfig(self, kube: FakeKube, path: Path) -> Path:
        kube.write_kubeconfig(path)
        config: dict[str, Any] = yaml.safe_load(path.read_text())
        config["users"][0]["user"] = {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "command": sys.executable,
                "args": [str(self.plugin), str(self.issued), str(self.lifetime_sec)],
                "interactiveMode": "Never",
            }
        }
        path.write_text(yaml.safe_dump(config))
        kube.authenticate = self.authenticate
        return path


def test_a_revoked_token_is_replaced_by_running_the_plugin_again_and_the_call_goes_through(
    fake_kube, tmp_path
):
    issuer = Issuer(tmp_path, lifetime_sec=3600)
    client = KubeClient.from_config(str(issuer.kubeconfig(fake_kube, tmp_path / "kc")), calls=None)
    assert client.get("Namespace", None, "default")
    assert list(issuer.tokens()) == ["tok-1"]

    issuer.revoke_all()  # e.g. rotated early: the plugin's next token is the good one
    assert client.get("Namespace", None, "default")

    assert list(issuer.tokens()) == ["tok-1", "tok-2"]
    assert issuer.refused == 1 and issuer.seen[-1] == "tok-2"
    # and from then on the new token is used without asking the plugin again
    assert client.list("Namespace", None)
    assert len(issuer.tokens()) == 2 and issuer.seen[-1] == "tok-2"


def test_a_token_near_its_expiry_is_replaced_before_the_server_refuses_it(fake_kube, tmp_path):
    # two minutes left is "near" (kubectl and the official client renew within five)
    issuer = Issuer(tmp_path, lifetime_sec=120)
    client = KubeClient.from_config(str(issuer.kubeconfig(fake_kube, tmp_path / "kc")), calls=None)
    client.credentials.look_sec = 0  # look at the expiry on every request
    for _ in range(3):
        assert client.get("Namespace", None, "default")
    assert issuer.refused == 0
    assert len(set(issuer.seen)) > 1  # a new token before the old one ran out


def test_a_plugin_that_fails_leaves_the_refusal_standing(fake_kube, tmp_path):
    issuer = Issuer(tmp_path, lifetime_sec=3600)
    client = KubeClient.from_config(str(issuer.kubeconfig(fake_kube, tmp_path / "kc")), calls=None)
    issuer.revoke_all()
    issuer.plugin.write_text("import sys; sys.exit('cannot reach the identity provider')\n")
    with pytest.raises(Forbidden, match="Unauthorized"):
        client.get("Namespace", None, "default")


@pytest.fixture
def kube(fake_kube: FakeKube) -> FakeKube:
    KubeClient.from_config(str(fake_kube.kubeconfig), calls=None).create(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )
    return fake_kube


def test_the_invoke_proxy_outside_the_cluster_follows_a_renewed_token_without_a_restart(
    kube, s3_server, tmp_path
):
    issuer = Issuer(tmp_path, lifetime_sec=3600)
    kubeconfig = issuer.kubeconfig(kube, tmp_path / "exec-kubeconfig")
    repo = WorkRepo(tmp_path / "functions")
    shutil.copytree(SAMPLE / "greeting" / "python", repo.path / "greeting", dirs_exist_ok=True)
    repo.commit("greeting")
    server = SlessServer(
        str(repo.path),
        tmp_path / "state",
        env=kube_env(kubeconfig, s3_server),
        args=["--backend", "kubernetes"],
    ).start()
    try:
        name = server.wait(
            lambda: next(
                (
                    f["name"]
                    for f in server.client.get("/api/v1/environments/prod/functions").json()
                    if f["phase"] == "Ready"
                ),
                None,
            ),
            "a function Ready",
        )
        assert server.call(name, "/").status_code == 200

        issuer.revoke_all()
        # the reconciler's next request (the lease, every few seconds) is refused and
        # renews the token; the proxy's calls go through again with it, no restart
        server.wait(
            lambda: server.call(name, "/").status_code == 200 and len(issuer.tokens()) > 1,
            "a call through the API server with the renewed token",
        )
        assert issuer.seen[-1] != "tok-1"
    finally:
        server.stop()
