"""Signing out ends the session on every reconciler replica (issue 33 item 16), through
their member Leases in the test API server.

From the attacker's side: someone holds a copy of a dashboard cookie (a shared machine,
a proxy's log) and keeps using it after its owner signed out, against another replica
behind the same Service. Refused once the replicas have told each other; accepted when
they do not (the protection off), which is what happened before.
"""

from __future__ import annotations

import time

from gitops_sless.kube.members import Members
from gitops_sless.serve.server import share_sign_outs
from gitops_sless.web.access import Access

from .test_kube_leader import NAMESPACE, client

__all__ = ["client"]  # the fixture: a client factory for the reconciler's namespace


def replica(client, holder: str, share: bool = True) -> tuple[Access, Members]:
    access = Access("api-token", "read-token")  # the same tokens: every replica's
    members = Members(client(), NAMESPACE, holder, renew_sec=0.1, lease_sec=2)
    if share:
        share_sign_outs(access, members)
    members.start()
    return access, members


def until(check, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_sign_out_on_one_replica_ends_the_session_on_every_replica(client):
    a, a_members = replica(client, "a")
    b, b_members = replica(client, "b")
    try:
        cookie = a.new_session()
        assert a.session_valid(cookie) and b.session_valid(cookie)  # one key, two replicas
        a.end_session(cookie)
        assert not a.session_valid(cookie)  # at once where it was signed out
        until(lambda: not b.session_valid(cookie), "the other replica to refuse the copy")
        # a replica started later learns it from those up: the cookie stays dead
        c, c_members = replica(client, "c")
        try:
            until(lambda: not c.session_valid(cookie), "a new replica to refuse it")
            assert c.session_valid(a.new_session())  # other sessions are untouched
        finally:
            c_members.stop()
    finally:
        a_members.stop()
        b_members.stop()


def test_without_sharing_another_replica_takes_the_copy(client):
    a, a_members = replica(client, "a", share=False)
    b, b_members = replica(client, "b", share=False)
    try:
        cookie = a.new_session()
        a.end_session(cookie)
        time.sleep(0.5)  # several rounds of theirs
        assert not a.session_valid(cookie) and b.session_valid(cookie)
    finally:
        a_members.stop()
        b_members.stop()


def test_what_another_replica_says_never_revives_a_session_or_breaks_one():
    access = Access("api-token")
    cookie = access.new_session()
    for junk in ("", "not json", "[1, 2]", '{"x": "soon"}', '{"' + "n" * 100 + '": 1}'):
        access.learn_signed_out(junk)
    assert access.session_valid(cookie)
    access.end_session(cookie)
    access.learn_signed_out("{}")
    assert not access.session_valid(cookie)
