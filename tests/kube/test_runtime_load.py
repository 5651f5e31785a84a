"""Issue 27 on Kubernetes: a function's load as its runtimes report it (``KubeBackend.busy``).

Each runtime server's ``GET /health`` reports ``busySeconds``, the integral of
its calls in flight since it started; the backend reads every ready pod's
through the API server's pod proxy and adds up what each process served, so
the total grows with the calls, whichever way they came, and never goes down
when a pod is replaced. Against the test API server, whose kubelet runs a
real runtime server for each pod of the function (``FakeKube.run_runtime``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.renderer import FUNCTION_LABEL
from gitops_sless.kube.runtimeload import PodLoad, _Function

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, Harness, make, settings
from ..kubeapi import FakeKube
from ..s3server import S3Server

PROD = "sless-prod"
HANDLER = (
    "import time\n\n\n"
    "def handler(event, context):\n"
    "    time.sleep(float(event.get('sleep', 0)))\n"
    "    return {'slept': event.get('sleep', 0)}\n"
)
CALL_SEC = 0.3


def wait_for(check: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def api(fake_kube: FakeKube) -> KubeClient:
    """A client that may make any call (the test's own: calls and deletions)."""
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return client


@contextlib.contextmanager
def served(
    kube: FakeKube, api: KubeClient, s3: S3Server, tmp_path: Path, name: str, handler: str
) -> Iterator[Harness]:
    """A reconciler serving the function ``name`` (two replicas, ``handler`` in main.py)
    whose pods run real runtime servers, once both serve."""
    repo = WorkRepo(tmp_path / "repo")
    files = {
        f"{name}/sless.yaml": (
            f"functions:\n  - name: {name}\n    runtime: python3.11\n"
            "    entrypoint: main.handler\n    replicas: 2\n    triggers:\n      - type: http\n"
        ),
        f"{name}/main.py": handler,
    }
    repo.commit(name, files)
    kube.run_runtime(PROD, name, repo.path / name)
    made = make(repo, tmp_path / "state", settings(kube.kubeconfig, s3.config()))
    try:
        made.sync()  # creates the namespace; the next pass watches what is in it
        made.sync()
        wait_for(lambda: len(serving(kube, api)) == 2, "two pods that serve")
        yield made
    finally:
        made.close()


@pytest.fixture
def harness(fake_kube: FakeKube, api: KubeClient, s3_server: S3Server, tmp_path: Path):
    with served(fake_kube, api, s3_server, tmp_path, "slow", HANDLER) as made:
        yield made


def pods(kube: FakeKube) -> list[dict[str, Any]]:
    return [p for p in kube.objects("Pod", PROD) if p["metadata"]["labels"].get(FUNCTION_LABEL)]


def serving(kube: FakeKube, api: KubeClient) -> list[str]:
    """The pods whose runtime answers its /health."""
    names = []
    for pod in pods(kube):
        try:
            health(api, pod["metadata"]["name"])
        except Exception:
            continue
        names.append(pod["metadata"]["name"])
    return names


def health(api: KubeClient, pod: str) -> dict[str, Any]:
    path = f"/api/v1/namespaces/{PROD}/pods/{pod}:8080/proxy/health"
    return json.loads(api.request("proxy", "Pod", "GET", path, attempts=1))


def call(api: KubeClient, pod: str, sleep: float) -> dict[str, Any]:
    """One call to the function on ``pod``, past the reconciler's proxy (as a Gateway's)."""
    path = f"/api/v1/namespaces/{PROD}/pods/{pod}:8080/proxy/"
    answer = api.request("proxy", "Pod", "POST", path, body={"sleep": sleep}, attempts=1)
    return json.loads(answer)


def calls(api: KubeClient, names: list[str], each: int) -> float:
    """``each`` calls of CALL_SEC on every pod of ``names``, all at once; the seconds taken."""
    started = time.monotonic()
    targets = [name for name in names for _ in range(each)]
    with ThreadPoolExecutor(len(targets)) as pool:
        answers = list(pool.map(lambda name: call(api, name, CALL_SEC), targets))
    assert all(a == {"slept": CALL_SEC} for a in answers), answers
    return time.monotonic() - started


def busy(harness: Harness) -> float | None:
    time.sleep(harness.backend.runtime_load.read_sec)  # not the answer of the last read
    return harness.backend.busy("prod", "slow")


def test_busy_grows_by_at_least_what_the_calls_took(fake_kube, api, harness):
    before = busy(harness)
    assert before is not None
    names = serving(fake_kube, api)
    took = calls(api, names, each=3)
    after = busy(harness)
    assert after is not None
    # each call counts at least its handler's sleep, and no longer than the test waited for it
    assert after - before >= 6 * CALL_SEC
    assert after - before <= 6 * took + 0.5
    # both runtimes were read: each served half of it
    assert all(health(api, name)["busySeconds"] >= 3 * CALL_SEC for name in names)


def test_busy_never_goes_down_when_a_pod_is_deleted_and_replaced(fake_kube, api, harness):
    names = serving(fake_kube, api)
    calls(api, names, each=2)
    before = busy(harness)
    assert before is not None and before >= 4 * CALL_SEC
    gone = names[0]
    api.delete("Pod", PROD, gone)
    seen = [before]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        value = busy(harness)
        assert value is not None  # the other pod answers all along
        seen.append(value)
        now = serving(fake_kube, api)
        if len(now) == 2 and gone not in now:
            break
    else:
        raise AssertionError("the deleted pod was not replaced")
    assert seen == sorted(seen), seen
    assert seen[-1] >= before
    # the new pod's process starts from nothing: what it serves is added to what was
    replacement = next(name for name in now if name != gone)
    calls(api, [replacement], each=2)
    after = busy(harness)
    assert after is not None and after - seen[-1] >= 2 * CALL_SEC


def test_busy_is_none_for_a_function_with_no_pods(harness):
    assert harness.backend.busy("prod", "nobody") is None
    assert harness.backend.busy("staging", "slow") is None  # no such namespace either


def _pod(uid: str, restarts: int = 0) -> PodLoad:
    return PodLoad(f"pod-{uid}", uid, "slow", restarts, True)


@pytest.mark.parametrize(
    ("readings", "total"),
    [
        pytest.param([[("a", 0, 1.0)], [("a", 0, 3.0)]], 3.0, id="one-process-grows"),
        pytest.param([[("a", 0, 1.0)], [("a", 0, 1.0)]], 1.0, id="no-calls-no-change"),
        pytest.param([[("a", 0, 5.0)], [("a", 1, 2.0)]], 7.0, id="restart-adds-new-process"),
        pytest.param(
            [[("a", 0, 5.0)], [("a", 0, 2.0)], [("a", 1, 3.0)]],
            8.0,
            id="restart-seen-before-its-count",
        ),
        pytest.param(
            [[("a", 0, 1.0), ("b", 0, 2.0)], [("b", 0, 4.0)], [("c", 0, 0.5)]],
            5.5,
            id="pods-replaced",
        ),
    ],
)
def test_each_process_adds_what_it_served(readings, total):
    function = _Function()
    last = 0.0
    for round_ in readings:
        pods = [_pod(uid, restarts) for uid, restarts, _ in round_]
        answer = function.add(pods, [value for _, _, value in round_])
        function.keep({p.uid for p in pods})
        assert answer is not None and answer >= last
        last = answer
    assert last == pytest.approx(total)


def test_no_answer_is_none_and_keeps_the_total():
    function = _Function()
    assert function.add([_pod("a")], [2.0]) == 2.0
    assert function.add([_pod("a")], [None]) is None
    assert function.add([], []) is None
    assert function.add([_pod("a")], [3.0]) == 3.0


def test_in_the_cluster_a_pod_is_read_at_its_address_not_through_the_api_server():
    """The environment's NetworkPolicies admit the reconciler's pods, not the API server."""
    from gitops_sless.kube.runtimeload import RuntimeLoad

    from ..proxy.test_proxy import _free_port, _start_runtime, _stop

    port = _free_port()
    runtime = _start_runtime(port)
    try:

        class InCluster:  # no API server at all: a read through it would fail
            in_cluster = True

        load = RuntimeLoad(InCluster())  # type: ignore[arg-type]
        load.port = port
        pod = PodLoad("slow-1", "uid-1", "slow", 0, True, "127.0.0.1")
        assert load._health(PROD, pod) == 0.0
        away = PodLoad("slow-2", "uid-2", "slow", 0, True, "")
        assert load._health(PROD, away) is None  # no address yet: nothing read
    finally:
        _stop(runtime)
