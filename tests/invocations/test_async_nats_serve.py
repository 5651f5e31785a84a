"""The same behaviour on NATS JetStream: a real ``gitops-sless serve --queue nats://`` and a
real nats-server; a reconciler killed mid-run, the NATS server killed, two replicas."""

from __future__ import annotations

import asyncio
import json

import nats

from ..natsserver import nats_server
from ..test_serve import HTTP, git_daemon, git_root, manifest, setup
from .test_async_durability import SLOW
from .test_async_serve import FLAKY, wait_ended

__all__ = ["git_daemon", "git_root", "nats_server", "setup"]  # fixtures


def test_202_retries_and_result_on_nats(setup, nats_server):
    setup.push(
        {
            "orders/sless.yaml": manifest("orders", HTTP, "    async: {retries: 2, backoff: 1s}"),
            "orders/handler.py": FLAKY,
        }
    )
    server = setup.serve(args=["--queue", nats_server.url])
    answer = server.call(
        "orders",
        "/x",
        method="POST",
        json={"ok_from": 2, "order": 3},
        headers={"Prefer": "respond-async"},
    )
    assert answer.status_code == 202, answer.text
    record = wait_ended(server, answer.headers["location"])
    assert record["status"] == "succeeded", record
    assert [a["statusCode"] for a in record["attemptLog"]] == [500, 200]
    assert json.loads(record["response"]["body"])["order"] == 3


def test_kill_9_of_the_reconciler_and_of_nats_loses_nothing(setup, nats_server):
    setup.push(
        {
            "slow/sless.yaml": manifest("slow", HTTP, "    async: {concurrency: 2}"),
            "slow/handler.py": SLOW,
        }
    )
    server = setup.serve(args=["--queue", nats_server.url])
    ids = [
        server.client.post(
            f"{server.base}/async/prod/slow/", json={"n": n, "sleep": 30 if n < 2 else 0.2}
        ).json()["id"]
        for n in range(6)
    ]

    def two_running() -> bool:
        listed = server.client.get("/api/v1/invocations", params={"status": "running"}).json()
        return len(listed) == 2

    server.wait(two_running, "two invocations running")
    server.kill()
    nats_server.restart()  # SIGKILL, then the same store

    again = setup.serve(args=["--queue", nats_server.url])
    ended = [wait_ended(again, f"/api/invocations/{one}", timeout=120) for one in ids]
    assert [e["status"] for e in ended] == ["succeeded"] * 6
    assert sorted(json.loads(e["response"]["body"])["n"] for e in ended) == list(range(6))
    cut = [e for e in ended if any(not a["counted"] for a in e["attemptLog"])]
    assert len(cut) == 2


def test_a_message_from_any_nats_client_fans_out(setup, nats_server):
    trigger = "    triggers: [{type: queue, subject: orders.created}]"
    echo = "def main(event, context):\n    return {'order': event.get('order')}\n"
    setup.push(
        {
            "billing/sless.yaml": manifest("billing", trigger),
            "billing/handler.py": echo,
            "shipping/sless.yaml": manifest("shipping", trigger),
            "shipping/handler.py": echo,
        }
    )
    server = setup.serve(args=["--queue", nats_server.url])

    async def publish() -> None:
        client = await nats.connect(nats_server.url)
        try:
            js = client.jetstream()
            await js.publish("orders.created", b'{"order": 5}')
        finally:
            await client.close()

    def subscribed() -> bool:
        # the events stream takes the subject once the server has read the declarations
        try:
            asyncio.run(publish())
        except Exception:
            return False
        return True

    server.wait(subscribed, "the events stream to take orders.created")

    def two_ended() -> list:
        listed = server.client.get("/api/v1/invocations", params={"status": "succeeded"}).json()
        return listed if len(listed) >= 2 else []

    listed = server.wait(two_ended, "both functions invoked")
    assert sorted(i["function"] for i in listed) == ["billing", "shipping"]
    assert all(i["subject"] == "orders.created" for i in listed)


def test_a_body_nats_cannot_hold_is_413_not_503(setup, nats_server):
    setup.push({"orders/sless.yaml": manifest("orders", HTTP), "orders/handler.py": FLAKY})
    server = setup.serve(args=["--queue", nats_server.url])
    # under the proxy's 1 MiB, over what one NATS message (1 MB max_payload) can carry
    answer = server.client.post(f"{server.base}/async/prod/orders/", content=b"x" * 900_000)
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"].startswith("request body larger than")
    small = server.client.post(f"{server.base}/async/prod/orders/", content=b"x" * 500_000)
    assert small.status_code == 202, small.text
