"""``scripts/run-kube`` is something ``kubectl`` can talk to.

Starts what run-kube starts (``python -m tests.kube_sandbox``: the test API server over
HTTPS with its own CA, the Function CRD installed, real S3, ``serve --backend kubernetes``)
on a small repository, and runs Debian's ``kubectl`` against the kubeconfig it prints.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..gitserver import WorkRepo, free_port
from ..paths import ROOT

GREETING = (ROOT / "sample-repo/greeting/python/greeting.py").read_text(encoding="utf-8")
MANIFEST = """\
functions:
  - name: {name}
    runtime: python3.11
    entrypoint: greeting.handler
    replicas: {replicas}
    triggers:
      - type: http
"""


def _kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, timeout=120)


def _kubeconfig_of(log: Path, sandbox: subprocess.Popen[bytes]) -> Path:
    """The kubeconfig path run-kube prints once its API server is up."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sandbox.poll() is None:
        found = re.search(r"\(kubeconfig (\S+)\)", log.read_text(encoding="utf-8"))
        if found:
            return Path(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"run-kube printed no kubeconfig:\n{log.read_text(encoding='utf-8')}")


def _wait_for_functions(kubeconfig: Path, count: int) -> None:
    """``kubectl wait`` needs the Function objects to exist: the first pass writes them."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        names = _kubectl(kubeconfig, "get", "fn", "-o", "name").stdout.split()
        if len(names) >= count:
            return
        time.sleep(0.2)
    raise AssertionError("the first pass wrote no Function resources")


@pytest.fixture(scope="module")
def run_kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A running run-kube on a repository of two greeting functions; its kubeconfig."""
    tmp = tmp_path_factory.mktemp("run-kube")
    repo = WorkRepo(tmp / "functions")
    repo.commit(
        "two greetings",
        {
            "hello/greeting.py": GREETING,
            "hello/sless.yaml": MANIFEST.format(name="hello", replicas=2),
            "hi/greeting.py": GREETING,
            "hi/sless.yaml": MANIFEST.format(name="hi", replicas=1),
        },
    )
    log = tmp / "run-kube.log"
    with log.open("wb") as out:
        sandbox = subprocess.Popen(
            [sys.executable, "-m", "tests.kube_sandbox", "--repo", str(repo.path),
             "--state-dir", str(tmp / "state"), "--listen", f"127.0.0.1:{free_port()}"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        kubeconfig = _kubeconfig_of(log, sandbox)
        _wait_for_functions(kubeconfig, 2)
        yield kubeconfig
    finally:
        sandbox.terminate()
        sandbox.wait(timeout=60)
    text = log.read_text(encoding="utf-8")
    assert "CRD is not installed" not in text, text


def test_kubectl_waits_until_every_function_is_ready(run_kube: Path) -> None:
    result = _kubectl(run_kube, "wait", "--for=condition=Ready", "fn", "--all", "--timeout=90s")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "function.gitops-sless.dev/hello condition met",
        "function.gitops-sless.dev/hi condition met",
    ]


def test_kubectl_get_fn_shows_the_functions_with_their_phase(run_kube: Path) -> None:
    _kubectl(run_kube, "wait", "--for=condition=Ready", "fn", "--all", "--timeout=90s")
    result = _kubectl(run_kube, "get", "fn")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "PHASE", "RUNTIME", "TAG"]
    assert [row.split()[:3] for row in rows] == [
        ["hello", "Ready", "python3.11"],
        ["hi", "Ready", "python3.11"],
    ]


def test_kubectl_shows_the_deployments_of_an_environment(run_kube: Path) -> None:
    _kubectl(run_kube, "wait", "--for=condition=Ready", "fn", "--all", "--timeout=90s")
    result = _kubectl(run_kube, "-n", "sless-prod", "get", "deploy")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert [row.split()[:4] for row in rows] == [
        ["hello", "2/2", "2", "2"],
        ["hi", "1/1", "1", "1"],
    ]


def test_kubectl_needs_the_token_and_trusts_only_the_servers_ca(
    run_kube: Path, tmp_path: Path
) -> None:
    config = yaml.safe_load(run_kube.read_text(encoding="utf-8"))
    wrong_token = copy.deepcopy(config)
    wrong_token["users"][0]["user"]["token"] = "wrong"
    result = _kubectl(_write(tmp_path / "wrong-token", wrong_token), "get", "fn")
    assert result.returncode != 0 and "Unauthorized" in result.stderr, result.stderr
    no_ca = copy.deepcopy(config)
    del no_ca["clusters"][0]["cluster"]["certificate-authority-data"]
    result = _kubectl(_write(tmp_path / "no-ca", no_ca), "get", "fn")
    assert result.returncode != 0 and "certificate" in result.stderr, result.stderr


def _write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path
