"""Notifications over a real status store, delivered to a real HTTP receiver: the event
kinds a serve test cannot reach cheaply (a rollback, previews, dead letters), each said
once and signed; and what the operator's file may and may not say."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from gitops_sless.notify import (
    Event,
    Notifications,
    NotifyConfig,
    NotifyConfigError,
    Provider,
    load,
)
from gitops_sless.state.store import Store
from gitops_sless.steps.rollouts import Verdict

from ..webhook_receiver import WebhookReceiver

KEY = b"a-key-for-the-service-tests"


@pytest.fixture
def receiver():
    found = WebhookReceiver()
    yield found
    found.close()


def notifying(tmp_path: Path, receiver: WebhookReceiver, **options) -> tuple[Store, Notifications]:
    store = Store(tmp_path / "status.db")
    options.setdefault("max_per_minute", 600)
    provider = Provider("hook", "webhook", url=f"{receiver.url}/hook", hmac_key=KEY, **options)
    notify = Notifications(NotifyConfig((provider,)), store, public_url="http://fn.example")
    return store, notify


def kinds(receiver: WebhookReceiver) -> list[str]:
    return [e["event"] for e in receiver.events("/hook")]


def delivered(notify: Notifications) -> None:
    notify.look()
    assert notify.outboxes["hook"].flush(30)


def test_a_rollback_is_said_once_signed_with_the_revisions(tmp_path, receiver):
    _, notify = notifying(tmp_path, receiver)
    try:
        verdict = Verdict(
            "prod", "greet", "r4", "r3", "c" * 40, "RolledBack", "r4 failed 30% of 50 calls"
        )
        notify.on_verdict(verdict)
        notify.on_verdict(Verdict("prod", "greet", "r5", "r4", "d" * 40, "Promoted", "ok"))
        assert notify.outboxes["hook"].flush(30)
        (event,) = receiver.events("/hook")
        assert event["event"] == "rolledBack" and event["revision"] == "r4"
        assert event["commit"] == "c" * 40 and "r3 takes every call" in event["cause"]
        assert all(d.signed_by(KEY) for d in receiver.accepted("/hook"))
    finally:
        notify.close()


def test_a_preview_is_ready_once_per_head_and_closed_once(tmp_path, receiver):
    store, notify = notifying(tmp_path, receiver)
    try:
        store.set_preview(7, state="Building", head="a" * 40)
        delivered(notify)
        assert kinds(receiver) == []
        store.set_preview(7, state="Ready")
        delivered(notify)
        delivered(notify)
        store.set_preview(7, state="Ready", head="b" * 40)  # a new head, ready again
        delivered(notify)
        store.set_preview(7, state="TearingDown")
        delivered(notify)
        store.set_preview(7, state="Closed")
        delivered(notify)
        events = receiver.events("/hook")
        assert [e["event"] for e in events] == ["previewReady", "previewReady", "previewClosed"]
        assert (
            events[0]["url"] == "http://fn.example/fn/pr-7/" and events[0]["environment"] == "pr-7"
        )
        assert [e["commit"] for e in events[:2]] == ["a" * 40, "b" * 40]
        assert all(d.signed_by(KEY) for d in receiver.accepted("/hook"))
    finally:
        notify.close()


def test_dead_letters_are_said_as_they_grow(tmp_path, receiver):
    _, notify = notifying(tmp_path, receiver)
    counts = {("prod", "greet"): 3}
    notify.watch_dead_letters(lambda: counts)
    try:
        delivered(notify)
        delivered(notify)  # the same count: nothing new
        counts[("prod", "greet")] = 5
        delivered(notify)
        counts[("prod", "greet")] = 0  # redriven: nothing to say
        delivered(notify)
        events = receiver.events("/hook")
        assert [(e["event"], e["count"], e["total"]) for e in events] == [
            ("deadLettered", 3, 3),
            ("deadLettered", 2, 5),
        ]
        assert (
            events[0]["summary"]
            == "prod/greet: 3 invocation(s) dead-lettered (3 in its dead letters)"
        )
    finally:
        notify.close()


def test_events_a_provider_did_not_ask_for_are_not_sent(tmp_path, receiver):
    store, notify = notifying(tmp_path, receiver, events=("previewClosed",))
    try:
        store.set_preview(8, state="Ready", head="a" * 40)
        notify.watch_dead_letters(lambda: {("prod", "greet"): 2})
        delivered(notify)
        store.set_preview(8, state="Closed")
        delivered(notify)
        assert kinds(receiver) == ["previewClosed"]
    finally:
        notify.close()


def test_a_look_at_a_store_with_what_served_before_announces_no_old_deploy(tmp_path, receiver):
    store = Store(tmp_path / "status.db")
    store.set_serving("prod", "old", {"seed": "{}"}, "a" * 40)
    store.set_function("prod", "old", phase="Ready", serving_revision="r1", revision="a" * 40)
    time.sleep(0.01)  # its serving row is older than the notifications
    provider = Provider(
        "hook", "webhook", url=f"{receiver.url}/hook", hmac_key=KEY, max_per_minute=600
    )
    notify = Notifications(NotifyConfig((provider,)), store, public_url="http://fn.example")
    try:
        delivered(notify)
        store.set_serving("prod", "old", {"seed": "{}"}, "b" * 40)
        store.set_function("prod", "old", phase="Ready", serving_revision="r2", revision="b" * 40)
        delivered(notify)
        assert [(e["event"], e["revision"]) for e in receiver.events("/hook")] == [
            ("deployed", "r2")
        ]
    finally:
        notify.close()


def write(tmp_path: Path, providers: list[dict]) -> Path:
    path = tmp_path / "notify.yaml"
    path.write_text(yaml.safe_dump({"providers": providers}))
    return path


@pytest.mark.parametrize(
    ("providers", "said"),
    [
        pytest.param(
            [{"name": "a", "kind": "pager", "url": "https://x.example"}],
            "providers[0].kind: 'pager' is not one of",
            id="unknown-kind",
        ),
        pytest.param(
            [{"name": "a", "kind": "slack"}],
            "providers[0]: exactly one of url and urlSecret is required",
            id="no-address",
        ),
        pytest.param(
            [{"name": "a", "kind": "forge", "url": "https://x.example"}],
            "a forge provider takes no url",
            id="forge-with-an-address",
        ),
        pytest.param(
            [{"name": "a", "kind": "teams", "url": "https://x.example", "hmacSecret": "k/h"}],
            "hmacSecret is for webhook providers, not teams",
            id="teams-with-a-key",
        ),
        pytest.param(
            [{"name": "a", "kind": "slack", "url": "hooks.slack.example/T0/B0/SECRET"}],
            "providers[0].url: must be an http:// or https:// URL",
            id="not-a-url-and-not-echoed",
        ),
        pytest.param(
            [{"name": "a", "kind": "webhook", "urlSecret": "../outside"}],
            "providers[0].urlSecret: '../outside' must be a file's path inside --secrets-dir",
            id="secret-outside-the-folder",
        ),
        pytest.param(
            [{"name": "a", "kind": "webhook", "url": "https://x.example", "events": ["sent"]}],
            "providers[0].events[0]: 'sent' is not one of",
            id="unknown-event",
        ),
        pytest.param(
            [
                {"name": "a", "kind": "webhook", "url": "https://x.example"},
                {"name": "a", "kind": "slack", "url": "https://y.example"},
            ],
            "providers: a named twice",
            id="same-name-twice",
        ),
        pytest.param(
            [{"name": "a", "kind": "webhook", "urlSecret": "notify/missing"}],
            "provider a: secret 'notify/missing' cannot be read",
            id="missing-secret",
        ),
    ],
)
def test_a_file_that_cannot_be_used_names_the_field_and_the_rule(tmp_path, providers, said):
    (tmp_path / "secrets").mkdir()
    with pytest.raises(NotifyConfigError) as caught:
        load(write(tmp_path, providers), tmp_path / "secrets")
    assert said in str(caught.value)
    assert "SECRET" not in str(caught.value)


def test_an_address_read_from_the_secrets_folder_is_kept_from_every_view(tmp_path):
    secrets = tmp_path / "secrets"
    (secrets / "notify").mkdir(parents=True)
    (secrets / "notify" / "url").write_text("https://hooks.slack.example/T000/B000/XXXX\n")
    config = load(
        write(tmp_path, [{"name": "chat", "kind": "slack", "urlSecret": "notify/url"}]), secrets
    )
    (provider,) = config.providers
    assert provider.url == "https://hooks.slack.example/T000/B000/XXXX"
    assert "XXXX" not in repr(provider) and not config.forge  # no forge provider: none
    store = Store(tmp_path / "status.db")
    notify = Notifications(config, store, public_url="http://fn.example")
    try:
        assert "XXXX" not in str(notify.status())
    finally:
        notify.close()


def test_without_a_file_only_the_forge_hears_of_rollouts(tmp_path):
    config = load(None, None)
    assert config.forge and [p.kind for p in config.providers] == ["forge"]


def test_events_that_wait_go_out_together_and_no_faster_than_the_rate_limit(tmp_path, receiver):
    _, notify = notifying(tmp_path, receiver, max_per_minute=1)
    outbox = notify.outboxes["hook"]
    try:
        receiver.holding.set()
        outbox.put([Event("previewClosed", "pr-1")])
        receiver.wait(lambda: receiver.held == 1, "the first message, held")
        outbox.put([Event("previewClosed", f"pr-{n}") for n in (2, 3, 4)])
        receiver.released.set()
        receiver.wait(lambda: receiver.accepted("/hook"), "the first message")
        # one message a minute: the three that waited are not sent yet, and go as one
        assert not outbox.flush(0.5)
        assert outbox.status()["pending"] == 3 and len(receiver.accepted("/hook")) == 1
    finally:
        notify.close()
    _, fast = notifying(tmp_path / "fast", receiver)
    try:
        receiver.holding.set()
        receiver.released.clear()
        first = len(receiver.deliveries)
        fast.outboxes["hook"].put([Event("previewClosed", "pr-5")])
        receiver.wait(lambda: receiver.held == 1, "a message, held")
        fast.outboxes["hook"].put([Event("previewClosed", f"pr-{n}") for n in (6, 7, 8)])
        receiver.released.set()
        assert fast.outboxes["hook"].flush(30)
        bodies = [[e["environment"] for e in d.events] for d in receiver.deliveries[first:]]
        assert bodies == [["pr-5"], ["pr-6", "pr-7", "pr-8"]]
    finally:
        fast.close()


def test_a_ready_preview_whose_row_is_gone_is_said_closed(tmp_path, receiver):
    store, notify = notifying(tmp_path, receiver)
    try:
        store.set_preview(9, state="Ready", head="a" * 40)
        delivered(notify)
        store.delete_preview(9)
        delivered(notify)
        delivered(notify)
        assert kinds(receiver) == ["previewReady", "previewClosed"]
    finally:
        notify.close()


def test_a_file_that_is_not_yaml_says_where_but_not_the_secret_in_the_line(tmp_path):
    path = tmp_path / "notify.yaml"
    path.write_text(
        "providers:\n"
        "  - name: chat\n"
        "    kind: slack\n"
        '    url: "https://hooks.slack.example/T0/B0/SECRET" oops: x\n'
    )
    with pytest.raises(NotifyConfigError) as caught:
        load(path, None)
    said = str(caught.value)
    assert said.startswith(f"{path}:4:") and "not valid YAML" in said
    assert "SECRET" not in said and "hooks.slack" not in said
    assert caught.value.__cause__ is None  # not chained: a traceback would print it
