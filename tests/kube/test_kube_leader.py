"""Leader election over a Lease in the test API server, with short durations."""

from __future__ import annotations

import time

import pytest

from gitops_sless.kube.client import KubeClient, NotLeader
from gitops_sless.kube.leader import LeaderElector

NAMESPACE = "gitops-sless"


@pytest.fixture
def client(fake_kube):
    setup = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    setup.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return lambda: KubeClient.from_config(str(fake_kube.kubeconfig))


def elector(client, holder: str) -> LeaderElector:
    return LeaderElector(
        client(),
        NAMESPACE,
        holder=holder,
        lease_sec=1.5,
        renew_sec=0.3,
        renew_deadline_sec=1.0,
        retry_sec=0.1,
    )


def wait_for(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_one_replica_leads_and_a_silent_leader_is_replaced_within_the_lease(client, fake_kube):
    old_leader_still_leads: list[bool] = []  # asked when the second acquires
    first = elector(client, "first")
    second = LeaderElector(
        client(),
        NAMESPACE,
        holder="second",
        lease_sec=1.5,
        renew_sec=0.3,
        renew_deadline_sec=1.0,
        retry_sec=0.1,
        on_change=lambda leads: leads and old_leader_still_leads.append(first.is_leader()),
    )
    first.start()
    wait_for(first.is_leader, "the first to lead")
    second.start()
    time.sleep(1.0)  # several rounds: the holder renews, the other keeps out
    assert first.is_leader() and not second.is_leader()
    lease = fake_kube.get("Lease", NAMESPACE, "gitops-sless")
    assert lease["spec"]["holderIdentity"] == "first"
    assert lease["spec"]["leaseDurationSeconds"] == 1
    # the leader stops renewing (as if SIGKILLed): it stops writing at its renew deadline,
    # before the lease expires, and the other takes over after the lease duration
    first._stop.set()
    wait_for(lambda: not first.is_leader(), "the old leader to stop writing", timeout=5)
    wait_for(second.is_leader, "the other to take over", timeout=5)
    # never two leaders: when the other took the lease (at its expiry) the old one had
    # stopped writing already (its renew deadline): an order, not a stopwatch
    assert old_leader_still_leads == [False]
    lease = fake_kube.get("Lease", NAMESPACE, "gitops-sless")
    assert lease["spec"]["holderIdentity"] == "second"
    assert lease["spec"]["leaseTransitions"] == 1
    second.stop()
    # a stop hands the lease over at once: an empty holder
    assert fake_kube.get("Lease", NAMESPACE, "gitops-sless")["spec"]["holderIdentity"] == ""


def test_a_replica_that_does_not_lead_writes_nothing(client, fake_kube):
    follower = client()
    follower.may_write = lambda: False
    fake_kube.reset_counts()
    with pytest.raises(NotLeader):
        follower.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "sless-prod"}}
        )
    assert not any(fake_kube.counts()["requests"].values())
