"""Replicas of the reconciler count each other through Leases of their own (kube/members.py),
and each proxy enforces its share of a rateLimit: together they admit what it says."""

from __future__ import annotations

import time

from gitops_sless.kube.members import Members
from gitops_sless.manifests.model import RateLimit
from gitops_sless.proxy.activator import Activator
from gitops_sless.state.routes import Route, RouteTable

from .test_kube_leader import NAMESPACE, client

__all__ = ["client"]  # the fixture


def test_replicas_count_each_other_and_one_that_stops_or_dies_drops_out(client):
    clock = {"now": 0.0}
    a, b, c = (
        Members(client(), NAMESPACE, name, lease_sec=15, clock=lambda: clock["now"])
        for name in ("replica-a", "replica-b", "replica-c")
    )
    a.round(), b.round(), c.round()
    assert a.round() == 3 and b.round() == 3
    b.stop()  # a clean stop deletes its lease: gone at once
    assert a.round() == 2
    # c is killed outright: its lease stays, unrenewed; after the lease duration it stops
    # counting, and later it is tidied away
    for _ in range(4):
        clock["now"] += 5
        a.round()
    assert a.count() == 1
    clock["now"] += 30
    a.round()
    names = [lease["metadata"]["name"] for lease in a.client.list("Lease", NAMESPACE)]
    assert names == [a.name]


def test_two_proxies_sharing_a_rate_limit_admit_its_burst_between_them():
    limit = RateLimit(0.001, 4)  # no refill to speak of during the test
    admitted = 0
    for _ in range(2):  # two replicas, each told by its members round that there are 2
        routes = RouteTable()
        route = Route("prod", "api", 30, (("127.0.0.1", 1),), rate_limit=limit)
        routes.set(route)
        activator = Activator(routes)
        activator.share = 1 / 2
        admitted += sum(activator.rate_limited(route, time.monotonic()) is None for _ in range(4))
    assert admitted == 4
