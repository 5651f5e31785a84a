"""What is told and when: a row is written only once its event is delivered, so an
event dropped at shutdown is sent by the next server, once; retries queue nothing twice;
a provider's worker survives what it did not expect."""

from __future__ import annotations

from pathlib import Path

import pytest

from gitops_sless.notify import Event, Notifications, NotifyConfig, Provider
from gitops_sless.notify.delivery import Outbox
from gitops_sless.state.store import Store

from ..webhook_receiver import WebhookReceiver


@pytest.fixture
def receiver():
    found = WebhookReceiver()
    yield found
    found.close()


def notifying(store: Store, receiver: WebhookReceiver) -> Notifications:
    provider = Provider("hook", "webhook", url=f"{receiver.url}/hook", max_per_minute=600)
    config = NotifyConfig((provider,))
    return Notifications(config, store, public_url="http://fn.example", backoff=0.05)


def failures(receiver: WebhookReceiver) -> list[dict]:
    return [e for e in receiver.events("/hook") if e["event"] == "startFailed"]


def test_a_failure_not_delivered_before_shutdown_is_sent_once_by_the_next_server(
    tmp_path: Path, receiver
):
    store = Store(tmp_path / "status.db")
    store.set_function("prod", "greet", phase="Failed", message="ImportError: no module x")
    receiver.answers = [503] * 1000
    notify = notifying(store, receiver)
    try:
        notify.look()
        receiver.wait(lambda: len(receiver.deliveries) >= 3, "three refused deliveries")
        store.set_function("prod", "other", phase="Failed", message="boom")
        notify.look()  # a look while the first failure waits: it is not queued again
        assert notify.outboxes["hook"].status()["pending"] == 2
    finally:
        notify.close()
    assert not failures(receiver)

    receiver.answers = []
    again = notifying(store, receiver)
    try:
        again.look()
        assert again.outboxes["hook"].flush(30)
        again.look()
        store.set_function("prod", "third", phase="Ready")  # the store changed: look again
        again.look()
        assert again.outboxes["hook"].flush(30)
    finally:
        again.close()
    assert sorted(e["function"] for e in failures(receiver)) == ["greet", "other"]

    third = notifying(store, receiver)  # delivered and written down: never again
    try:
        third.look()
        assert third.outboxes["hook"].flush(30)
    finally:
        third.close()
    assert sorted(e["function"] for e in failures(receiver)) == ["greet", "other"]


def test_a_provider_that_failed_very_often_still_retries(tmp_path: Path, receiver):
    sent: list[int] = []

    def send(provider, events):
        sent.append(len(events))
        if len(sent) == 1:
            raise ConnectionError("HTTP 503")

    outbox = Outbox(Provider("hook", "webhook", url="http://x.example"), send, backoff=0.0)
    try:
        outbox._failures = 5000  # 2 ** 4999 seconds is too large a float
        outbox.put([Event("previewClosed", "pr-1")])
        assert outbox.flush(10)
        assert sent == [1, 1] and outbox.status()["delivered"] == 1
    finally:
        outbox.close()


@pytest.mark.parametrize(
    ("kind", "limit"),
    [pytest.param("teams", 28_000, id="teams"), pytest.param("slack", 40_000, id="slack")],
)
def test_a_storm_of_failures_goes_out_in_messages_the_receiver_takes(receiver, kind, limit):
    provider = Provider("chat", kind, url=f"{receiver.url}/chat", max_per_minute=6000)
    outbox = Outbox(provider)
    try:
        causes = [f"cause-{n:02}: " + "Traceback line\n" * 70 for n in range(40)]
        outbox.put([Event("startFailed", "prod", f"fn-{n}", cause=c) for n, c in enumerate(causes)])
        assert outbox.flush(30)
        bodies = [d.body for d in receiver.accepted("/chat")]
        assert len(bodies) > 1 and all(len(b) < limit for b in bodies)
        said = b"".join(bodies).decode()
        assert all(f"cause-{n:02}" in said for n in range(40))  # none dropped
        assert outbox.status()["dropped"] == 0
    finally:
        outbox.close()


def test_a_message_refused_as_too_large_is_split_and_sent(receiver):
    receiver.answers = [413]
    provider = Provider("hook", "webhook", url=f"{receiver.url}/hook", max_per_minute=6000)
    outbox = Outbox(provider)
    try:
        outbox.put([Event("previewClosed", f"pr-{n}") for n in range(4)])
        assert outbox.flush(30)
        bodies = [[e["environment"] for e in d.events] for d in receiver.accepted("/hook")]
        assert [env for b in bodies for env in b] == [f"pr-{n}" for n in range(4)]
        assert len(bodies) >= 2 and outbox.status()["dropped"] == 0
    finally:
        outbox.close()
