"""End to end: ``serve --notify-config`` tells a real HTTP receiver of deploys and
failures (issue 31): a generic webhook signed as Flux's generic-hmac provider signs,
Slack's Block Kit and Teams' Adaptive Card messages in their documented shapes. An
incident is one message however many passes it lasts, and a restart does not say it
again; its end is one ``resolved`` message. A receiver that answers 500 gets the
message again; one that hangs holds back no pass; a filtered environment sends nothing.
Addresses are secrets: never in the log or the status API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from . import chat_schemas, gitserver
from .gitserver import AUTHOR
from .test_rollouts import function as rolled_out
from .test_serve import HTTP, handler, http_function, manifest, setup
from .test_serve_failures import JOB_RAISES, PY_HANDLER, PY_SYNTAX
from .webhook_receiver import WebhookReceiver

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

KEY = b"a-notification-key-for-tests"
NO_INDEX = {"PIP_NO_INDEX": "1"}  # a build that asks for a package fails at once
DOWN = "def main(event, context):\n    return {'statusCode': 500, 'body': 'down'}\n"


def notify_args(
    setup, receiver: WebhookReceiver, providers: list[dict[str, Any]], env: dict | None = None
) -> dict:
    """serve's keyword arguments for ``providers``: each one's address (the receiver, at
    ``/<name>``) in a secret file, the webhooks' key beside it; an incident resolves at
    its first healthy look (no grace: these tests do not flap)."""
    secrets = setup.tmp_path / "secrets"
    (secrets / "notify").mkdir(parents=True, exist_ok=True)
    (secrets / "notify" / "hmac").write_bytes(KEY + b"\n")
    for provider in providers:
        (secrets / "notify" / provider["name"]).write_text(f"{receiver.url}/{provider['name']}\n")
        provider.setdefault("urlSecret", f"notify/{provider['name']}")
        if provider["kind"] == "webhook":
            provider.setdefault("hmacSecret", "notify/hmac")
    path = setup.tmp_path / "notify.yaml"
    path.write_text(yaml.safe_dump({"providers": providers}))
    env = {"SLESS_NOTIFY_GRACE_SEC": "0", **(env or {})}
    return {"secrets_dir": secrets, "args": ["--notify-config", str(path)], "env": env}


def of(events: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict]:
    return [e for e in events if e["event"] == kind and name in (None, e.get("function"))]


def barrier(setup, server, receiver: WebhookReceiver, name: str, n: int) -> None:
    """Deploy ``name`` for the ``n``-th time and wait for its message: every look before
    it has been delivered (each provider sends in order)."""
    setup.push(http_function(name, f"barrier {n}"))
    server.sync()
    receiver.wait(
        lambda: any(
            e.get("revision") == f"r{n}" for e in of(receiver.events("/hook"), "deployed", name)
        ),
        f"{name} r{n} deployed",
    )


def test_an_incident_is_one_message_and_its_end_one_resolved_across_a_restart(setup):
    receiver = WebhookReceiver()
    try:
        kwargs = notify_args(
            setup,
            receiver,
            [
                {"name": "hook", "kind": "webhook", "environments": ["prod"]},
                {"name": "chat", "kind": "slack"},
                {"name": "team", "kind": "teams"},
            ],
            env=NO_INDEX,
        )
        first = setup.push(http_function("greet", "v1"))
        server = setup.serve(**kwargs)

        (deployed,) = receiver.wait(
            lambda: of(receiver.events("/hook"), "deployed", "greet"), "greet deployed"
        )
        assert deployed["environment"] == "prod" and deployed["revision"] == "r1"
        assert deployed["commit"] == first and deployed["author"] == AUTHOR[0]
        assert deployed["url"].endswith("/fn/prod/greet/")

        # a build that fails, pass after pass: one message
        setup.push(
            {"greet/handler.py": handler("v2"), "greet/requirements.txt": "no-such-package==1\n"}
        )
        for _ in range(10):
            server.sync()
        (failed,) = receiver.wait(
            lambda: of(receiver.events("/hook"), "buildFailed", "greet"), "greet's build failure"
        )
        assert "no-such-package" in failed["cause"]
        assert failed["summary"].startswith("prod/greet: build failed")
        barrier(setup, server, receiver, "other", 1)

        # a restart of the reconciler says neither again
        server.stop()
        server = setup.serve(**kwargs)
        server.sync()
        barrier(setup, server, receiver, "other", 2)
        assert len(of(receiver.events("/hook"), "buildFailed")) == 1
        assert len(of(receiver.events("/hook"), "deployed", "greet")) == 1

        # the fix: one resolved, saying how long it lasted, and the deploy
        setup.push({"greet/requirements.txt": None})
        server.sync()
        (resolved,) = receiver.wait(
            lambda: of(receiver.events("/hook"), "resolved", "greet"), "greet resolved"
        )
        assert resolved["resolves"] == "buildFailed"
        assert resolved["durationSeconds"] >= 0 and resolved["since"] < resolved["time"]
        assert " after " in resolved["summary"]
        server.sync()
        barrier(setup, server, receiver, "other", 3)
        hook = receiver.events("/hook")
        assert len(of(hook, "resolved")) == 1 and len(of(hook, "buildFailed")) == 1
        assert [e["revision"] for e in of(hook, "deployed", "greet")] == ["r1", "r2"]

        # every webhook message signed; Slack's and Teams' in their documented shapes
        webhooks = receiver.accepted("/hook")
        assert webhooks and all(d.signed_by(KEY) for d in webhooks)
        assert not any(d.signed_by(b"another key") for d in webhooks)
        slack = [d.json for d in receiver.accepted("/chat")]
        teams = [d.json for d in receiver.accepted("/team")]
        for message in slack:
            chat_schemas.check(chat_schemas.SLACK, message)
        for message in teams:
            chat_schemas.check(chat_schemas.TEAMS, message)
        assert "x-signature" not in receiver.accepted("/chat")[0].headers
        said = [b["text"]["text"] for m in slack for b in m["blocks"] if b["type"] == "section"]
        assert sum(text.startswith("*prod/greet: build failed") for text in said) == 1
        assert sum(text.startswith("*prod/greet: resolved after") for text in said) == 1
        cards = " ".join(str(m["attachments"][0]["content"]["body"]) for m in teams)
        assert cards.count("prod/greet: build failed") == 1
        assert cards.count("prod/greet: resolved after") == 1

        # addresses are secrets: in no log line, not in the status API
        status = server.client.get("/api/v1/notifications").json()
        providers = {p["name"]: p for p in status["providers"]}
        assert providers["hook"]["kind"] == "webhook" and providers["hook"]["lastOk"] is True
        assert providers["hook"]["lastDelivered"] and providers["hook"]["delivered"] >= 2
        assert receiver.url not in str(status)
        assert str(receiver.server.server_address[1]) not in server.output()
    finally:
        receiver.close()


def test_a_start_failure_and_a_job_failure_carry_their_cause(setup):
    receiver = WebhookReceiver()
    try:
        kwargs = notify_args(setup, receiver, [{"name": "hook", "kind": "webhook"}])
        setup.push(
            {
                "pybad/sless.yaml": manifest("pybad", HTTP),
                "pybad/handler.py": PY_HANDLER,
                "pybad/helper.py": PY_SYNTAX,
                "summer/sless.yaml": manifest(
                    "summer",
                    "    jobs:",
                    "      - {name: sum-numbers, runId: 1, event: {numbers: [1, 2, 3]}}",
                    entrypoint="handler.run",
                ),
                "summer/handler.py": JOB_RAISES,
            }
        )
        server = setup.serve(**kwargs)
        (start,) = receiver.wait(
            lambda: of(receiver.events("/hook"), "startFailed", "pybad"), "pybad's start failure"
        )
        assert "SyntaxError: '{' was never closed" in start["cause"]
        assert start["cause"] == server.function("pybad")["message"]  # what the status API shows
        (job,) = receiver.wait(
            lambda: [e for e in receiver.events("/hook") if e["event"] == "jobFailed"],
            "the job's failure",
        )
        assert job["job"] == "sum-numbers" and "ZeroDivisionError" in job["cause"]
        assert all(d.signed_by(KEY) for d in receiver.accepted("/hook"))
        # the receiver holds the message before the outbox hears its answer and counts it
        delivered = 'sless_notifications_total{provider="hook",result="delivered"}'
        metrics = server.wait(
            lambda: delivered in (text := server.client.get("/metrics").text) and text,
            "the delivery counted",
        )
        assert 'sless_notification_events_total{event="startFailed",provider="hook"} 1' in metrics
    finally:
        receiver.close()


def test_a_500_is_retried_and_a_filtered_environment_hears_nothing(setup):
    receiver = WebhookReceiver()
    receiver.answers = [500]
    try:
        kwargs = notify_args(
            setup,
            receiver,
            [
                {"name": "hook", "kind": "webhook", "environments": ["prod"]},
                {"name": "staging", "kind": "webhook", "environments": ["staging", "pr-*"]},
                {"name": "others", "kind": "webhook", "functions": ["not-greet-*"]},
            ],
        )
        setup.push(http_function("greet", "v1"))
        server = setup.serve(**kwargs)
        receiver.wait(lambda: of(receiver.events("/hook"), "deployed", "greet"), "greet deployed")
        refused = [d for d in receiver.deliveries if d.path == "/hook" and d.status == 500]
        assert len(refused) == 1  # the same message, tried again
        assert refused[0].events == receiver.accepted("/hook")[0].events
        assert refused[0].signed_by(KEY)

        def providers() -> dict[str, Any] | None:  # once the outbox has heard the answer
            status = server.client.get("/api/v1/notifications").json()["providers"]
            by_name = {p["name"]: p for p in status}
            return by_name if by_name["hook"]["lastOk"] else None

        status = server.wait(providers, "hook's delivery")
        assert status["hook"]["retried"] == 1 and status["hook"]["lastOk"] is True
        # the look that queued the deploy for hook queued nothing for the filtered ones
        assert status["staging"]["events"] == 0 and status["others"]["events"] == 0
        assert not [d for d in receiver.deliveries if d.path in ("/staging", "/others")]
        metrics = server.client.get("/metrics").text
        assert 'sless_notifications_total{provider="hook",result="retried"} 1' in metrics
    finally:
        receiver.close()


def test_a_receiver_that_hangs_holds_back_no_pass(setup):
    receiver = WebhookReceiver()
    receiver.holding.set()
    try:
        kwargs = notify_args(
            setup, receiver, [{"name": "hook", "kind": "webhook", "timeoutSeconds": 120}]
        )
        setup.push(http_function("greet", "v1"))
        server = setup.serve(**kwargs)
        receiver.wait(lambda: receiver.held == 1, "the first message, held by the receiver")

        before = sum(s["count"] for s in server.syncs())  # passes, repeated ones counted
        commit = setup.push(http_function("greet", "v2"))
        assert server.sync()["revision"] == commit
        assert server.call("greet").json()["message"] == "v2"
        server.sync()
        assert sum(s["count"] for s in server.syncs()) >= before + 2
        assert receiver.held == 1 and not receiver.accepted("/hook")  # still hanging

        receiver.released.set()
        receiver.wait(
            lambda: [e for e in of(receiver.events("/hook"), "deployed") if e["revision"] == "r2"],
            "r2's deploy, once the receiver answers",
        )
    finally:
        receiver.close()


def test_a_notify_config_that_breaks_the_schema_stops_serve_with_its_field(tmp_path: Path):
    import subprocess
    import sys

    bad = tmp_path / "notify.yaml"
    bad.write_text("providers:\n  - {name: hook, kind: pager, url: 'https://x.example'}\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    found = subprocess.run(
        [sys.executable, "-m", "gitops_sless", "serve", "--repo", str(repo),
         "--state-dir", str(tmp_path / "state"), "--notify-config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert found.returncode == 2, found.stderr
    assert "providers[0].kind: 'pager' is not one of" in found.stderr


def test_a_rollback_and_dead_letters_reach_the_webhook_signed(setup):
    receiver = WebhookReceiver()
    try:
        kwargs = notify_args(
            setup,
            receiver,
            [{"name": "hook", "kind": "webhook", "events": ["rolledBack", "deadLettered"]}],
        )
        setup.push(
            {
                **rolled_out("v1"),
                "orders/sless.yaml": manifest("orders", HTTP, "    async: {retries: 0}"),
                "orders/handler.py": DOWN,
            }
        )
        server = setup.serve(**kwargs)

        # a candidate that cannot start is rolled back at once
        broken = rolled_out("v2")
        broken["hello/handler.py"] = "raise RuntimeError('no start')\n" + broken["hello/handler.py"]
        setup.push(broken)
        server.sync()
        (rolled,) = receiver.wait(
            lambda: of(receiver.events("/hook"), "rolledBack", "hello"), "the rollback"
        )
        assert rolled["revision"] == "r2" and "r1 takes every call" in rolled["cause"]

        # two invocations whose only attempt fails: two dead letters
        for _ in range(2):
            answer = server.client.post(f"{server.base}/async/prod/orders/", json={})
            assert answer.status_code == 202, answer.text

        def dead() -> list[dict[str, Any]]:
            server.sync()  # a pass wakes the notifications (the queue counts every 5 s)
            found = of(receiver.events("/hook"), "deadLettered", "orders")
            return found if sum(e["count"] for e in found) == 2 else []

        found = server.wait(dead, "two dead letters said")
        assert found[-1]["total"] == 2
        assert not of(receiver.events("/hook"), "deployed")  # not asked for
        assert all(d.signed_by(KEY) for d in receiver.accepted("/hook"))
    finally:
        receiver.close()
