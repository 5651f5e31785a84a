"""The watch-fed view: WATCH as the test API server serves it, the informer that keeps a kind
in memory, and the backend's passes that read it (zero requests when nothing changed).

Requests are counted by the test API server itself (``FakeKube.counts``)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.informer import Informer

from ..gitserver import WorkRepo
from ..kubeapi import FakeKube
from .test_kube_backend import PROD, function_folder, harness_for, kube, wait_for  # noqa: F401

NS = "informed"
SELECTOR = {"app.kubernetes.io/managed-by": "gitops-sless"}


def config_map(name: str, value: str = "1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": NS, "labels": dict(SELECTOR)},
        "data": {"value": value},
    }


@pytest.fixture
def admin(fake_kube: FakeKube) -> KubeClient:
    """Someone with kubectl: any call, counted by the server like the reconciler's."""
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    return client


@pytest.fixture
def informer(fake_kube: FakeKube, admin: KubeClient) -> Iterator[Informer]:
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    made = Informer(client, "ConfigMap", NS, SELECTOR, backoff_sec=(0.05, 0.2))
    yield made
    made.stop()


def requests(server: FakeKube, verb: str | None = None) -> int:
    counts = server.counts()["requests"]
    return sum(n for (v, _), n in counts.items() if verb in (None, v))


def values(informer: Informer) -> dict[str, str]:
    return {o["metadata"]["name"]: o["data"]["value"] for o in informer.items()}


# --- WATCH as the real API server serves it ------------------------------------------------


def raw_watch(server: FakeKube, path: str) -> tuple[int, list[dict[str, Any]], bool]:
    """(status, events, ended cleanly) of one watch read to its end."""
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {server.token}"})
    response = conn.getresponse()
    clean = True
    try:
        body = response.read()
    except http.client.IncompleteRead as cut:  # no terminating chunk
        body, clean = cut.partial, False
    conn.close()
    return response.status, [json.loads(line) for line in body.splitlines() if line], clean


def test_watch_serves_changes_after_a_version_bookmarks_and_ends_on_its_timeout(fake_kube, admin):
    listed = admin._json("list", "ConfigMap", "GET", f"/api/v1/namespaces/{NS}/configmaps")
    start = listed["metadata"]["resourceVersion"]
    made = admin.create(config_map("a"))
    admin.create({**config_map("b"), "metadata": {"name": "b", "namespace": NS}})  # unlabelled
    fake_kube.store.bookmark_sec = 0.3
    path = f"/api/v1/namespaces/{NS}/configmaps?watch=true&resourceVersion={start}"
    status, events, clean = raw_watch(
        fake_kube,
        f"{path}&labelSelector=app.kubernetes.io/managed-by%3Dgitops-sless"
        "&allowWatchBookmarks=true&timeoutSeconds=1",
    )
    assert status == 200 and clean
    # the change after the version, filtered by the selector; then bookmarks only
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events[:1]] == [("ADDED", "a")]
    assert events[0]["object"]["metadata"]["resourceVersion"] == made["metadata"]["resourceVersion"]
    marks = events[1:]
    assert marks and all(e["type"] == "BOOKMARK" for e in marks)
    for mark in marks:  # a bookmark is the kind and a resourceVersion, nothing else
        assert mark["object"] == {
            "kind": "ConfigMap",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": fake_kube.store.resource_version},
        }
    # without allowWatchBookmarks: no bookmark at all
    _, events, _ = raw_watch(fake_kube, f"{path}&timeoutSeconds=1")
    assert [e["type"] for e in events] == ["ADDED", "ADDED"]


def test_a_watch_from_a_compacted_version_gets_410_gone_as_an_error_event(fake_kube, admin):
    first = admin.create(config_map("a"))["metadata"]["resourceVersion"]
    admin.create(config_map("b"))
    fake_kube.store.compact()
    path = f"/api/v1/namespaces/{NS}/configmaps?watch=true&resourceVersion={first}"
    status, events, clean = raw_watch(fake_kube, path + "&timeoutSeconds=5")
    assert status == 200 and clean  # answered at once, not after the timeout
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    error = events[0]["object"]
    assert (error["kind"], error["code"], error["reason"]) == ("Status", 410, "Expired")
    assert error["message"].startswith("too old resource version")
    # from the current version the watch works
    now = fake_kube.store.resource_version
    status, events, _ = raw_watch(fake_kube, path.replace(first, now) + "&timeoutSeconds=1")
    assert status == 200 and events == []


def test_dropped_watches_end_without_their_last_chunk(fake_kube, admin):
    now = fake_kube.store.resource_version
    path = f"/api/v1/namespaces/{NS}/configmaps?watch=true&resourceVersion={now}"
    result: list[Any] = []
    reader = threading.Thread(target=lambda: result.append(raw_watch(fake_kube, path)))
    reader.start()
    wait_for(lambda: requests(fake_kube, "watch"), "the watch to start")
    for _ in range(100):  # until the stream, once open, is cut
        fake_kube.store.drop_watches()
        reader.join(0.1)
        if not reader.is_alive():
            break
    assert result and result[0][0] == 200 and result[0][2] is False


# --- the informer ------------------------------------------------------------------------


def test_a_synced_informer_makes_no_request_when_nothing_changed(fake_kube, admin, informer):
    admin.create(config_map("a"))
    informer.sync()
    assert values(informer) == {"a": "1"}
    admin.apply(config_map("a", "2"))
    wait_for(lambda: values(informer) == {"a": "2"}, "the change to come by watch")
    fake_kube.reset_counts()
    for _ in range(5):
        informer.sync()
    assert requests(fake_kube) == 0, fake_kube.counts()["requests"]


def test_a_watch_cut_mid_pass_never_leaves_a_stale_read(fake_kube, admin, informer):
    admin.create(config_map("a"))
    admin.create(config_map("b"))
    informer.sync()
    wait_for(lambda: requests(fake_kube, "watch"), "the watch")
    fake_kube.store.drop_watches()
    wait_for(lambda: not informer.fresh, "the cut to be noticed")
    admin.delete("ConfigMap", NS, "a")  # by hand, while the watch is down or resuming
    fake_kube.reset_counts()
    informer.sync()  # the next pass: a fresh LIST, never the cache the cut left
    assert values(informer) == {"b": "1"}
    assert requests(fake_kube, "list") <= 1
    # and the watch carries on from that LIST
    admin.apply(config_map("b", "3"))
    wait_for(lambda: values(informer) == {"b": "3"}, "the watch to resume")


def test_a_cut_watch_resumes_from_its_last_bookmark_without_a_list(fake_kube, admin, informer):
    fake_kube.store.bookmark_sec = 0.1
    admin.create(config_map("a"))
    informer.sync()
    version = informer._rv
    # changes elsewhere move the server's version; bookmarks move the informer's with it
    admin.create({**config_map("other"), "kind": "Secret", "data": {}})
    assert informer._rv == version
    # (a bookmark carries the server's version: the informer is where the server is)
    wait_for(lambda: informer._rv == fake_kube.store.resource_version != version, "a bookmark")
    fake_kube.store.compact()  # the history before the bookmark is gone
    fake_kube.reset_counts()
    fake_kube.store.drop_watches()
    wait_for(lambda: requests(fake_kube, "watch") >= 1, "the watch to resume")
    wait_for(lambda: informer.fresh, "a bookmark on the resumed watch")
    assert requests(fake_kube, "list") == 0  # resumed where it was: no 410, no LIST
    admin.apply(config_map("a", "2"))
    wait_for(lambda: values(informer) == {"a": "2"}, "the change")


def test_410_gone_lists_again_and_the_cache_is_whole(fake_kube, admin, informer):
    admin.create(config_map("a"))
    informer.sync()
    wait_for(lambda: requests(fake_kube, "watch"), "the watch")
    fake_kube.store.drop_watches()
    # while it is cut: changes, then the history of them is compacted away
    admin.delete("ConfigMap", NS, "a")
    admin.create(config_map("c"))
    fake_kube.store.compact()
    wait_for(lambda: informer.relists == 2 and informer.fresh, "the relist after 410 Gone")
    assert values(informer) == {"c": "1"}
    fake_kube.reset_counts()
    informer.sync()  # the relist was made already: the pass reads the cache
    assert requests(fake_kube) == 0


def test_a_write_conflict_is_retried_and_its_answer_is_what_the_cache_holds(
    fake_kube, admin, informer
):
    admin.create(config_map("a"))
    informer.sync()
    fake_kube.inject("apply", "ConfigMap", 409, times=2)
    written = informer.client.apply(config_map("a", "2"))
    informer.put(written)
    assert values(informer) == {"a": "2"}
    # the watch's events of the same object, older or the same, never take it back
    stale = {**written, "data": {"value": "old"}}
    stale["metadata"] = {**written["metadata"], "resourceVersion": "1"}
    informer._upsert(stale)
    assert values(informer) == {"a": "2"}
    assert fake_kube.counts()["requests"][("apply", "ConfigMap")] == 3


# --- the backend's passes ------------------------------------------------------------------


def two_functions(tmp_path: Any, harness_for: Any) -> Any:  # noqa: F811
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    harness = harness_for(repo)
    harness.sync()
    wait_for(lambda: harness.sync() and harness.function("alpha")["phase"] == "Ready", "Ready")
    wait_for(lambda: harness.sync() and harness.function("beta")["phase"] == "Ready", "Ready")
    return harness


def test_a_pass_with_no_change_makes_zero_requests(kube, harness_for, tmp_path):  # noqa: F811
    harness = two_functions(tmp_path, harness_for)
    kube.reset_counts()
    for _ in range(3):
        harness.sync()
    counts = kube.counts()["requests"]
    assert requests(kube) - requests(kube, "watch") == 0, counts
    # an informer's watch that opens late or reconnects (a loaded machine) is its stream's,
    # not a pass's: at most once a kind, never once a pass
    assert all(n <= 1 for (verb, _), n in counts.items() if verb == "watch"), counts


def test_an_object_deleted_by_hand_between_passes_is_back_after_the_next(
    kube,  # noqa: F811
    harness_for,  # noqa: F811
    tmp_path,
):
    harness = two_functions(tmp_path, harness_for)
    admin = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    admin.delete("Service", PROD, "alpha")
    view = harness.backend.view("prod")
    wait_for(lambda: view.get("Service", "alpha") is None, "the deletion to come by watch")
    kube.reset_counts()
    harness.sync()
    assert kube.get("Service", PROD, "alpha") is not None
    assert requests(kube, "list") == 0  # known from the watch, not from a LIST
    assert kube.counts()["writes"] == {("apply", "Service"): 1}


def test_a_hand_edit_is_drift_repaired_from_the_watch(kube, harness_for, tmp_path):  # noqa: F811
    harness = two_functions(tmp_path, harness_for)
    admin = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    admin.patch("Deployment", PROD, "beta", {"spec": {"replicas": 3}})
    view = harness.backend.view("prod")
    wait_for(lambda: view.get("Deployment", "beta")["spec"]["replicas"] == 3, "the edit")
    kube.reset_counts()
    harness.sync()
    assert kube.get("Deployment", PROD, "beta")["spec"]["replicas"] == 1
    # no LIST of what is cached (its pods are read: a rollout is under way)
    assert [k for (v, k) in kube.counts()["requests"] if v == "list"] in ([], ["Pod"])


def test_a_pass_after_a_cut_watch_lists_afresh_and_repairs(kube, harness_for, tmp_path):  # noqa: F811
    harness = two_functions(tmp_path, harness_for)
    admin = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    informers = harness.backend.view("prod")._informers.values()
    deployments = harness.backend.view("prod")._informers["Deployment"]
    kube.store.drop_watches()
    admin.delete("Deployment", PROD, "alpha")  # while the watch is cut
    kube.store.compact()  # and its history is gone too: a resumed watch gets 410
    # the Deployments' informer is the one whose cache the pass must not trust: wait for
    # it to notice (another kind noticing first said nothing of it)
    wait_for(lambda: not deployments.fresh, "the cut to be noticed")
    harness.sync()  # never planned from the cache the cut left: the deletion is seen
    assert kube.get("Deployment", PROD, "alpha") is not None
    wait_for(lambda: harness.sync() and harness.function("alpha")["phase"] == "Ready", "Ready")
    wait_for(lambda: all(i.fresh for i in informers), "the watches to be sound again")
    wait_for(lambda: quiet(kube), "every cut watch (builds' too) to be open again")
    kube.reset_counts()
    harness.sync()
    assert requests(kube) == 0, kube.counts()["requests"]


def quiet(server: FakeKube, sec: float = 0.5) -> bool:
    """No request for ``sec``: the watchers that resumed, relisted or backed off are done."""
    before = dict(server.counts()["requests"])
    time.sleep(sec)
    return dict(server.counts()["requests"]) == before
