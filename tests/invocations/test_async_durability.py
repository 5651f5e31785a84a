"""Nothing accepted is lost: a reconciler killed with invocations queued and running, a
restart, retention; queue triggers; metrics. A real server on the SQLite queue."""

from __future__ import annotations

import json
from typing import Any

from ..test_serve import HTTP, git_daemon, git_root, manifest, setup
from .test_async_serve import wait_ended, write

__all__ = ["git_daemon", "git_root", "setup"]  # the fixtures, shared with test_serve

SLOW = """\
import time

def main(event, context):
    attempt = event['_headers'].get('x-invocation-attempt')
    if attempt == '1':  # the first attempt only: one cut short runs again at once
        time.sleep(float(event.get('sleep', 0)))
    return {'n': event.get('n'), 'attempt': attempt}
"""

ECHO = """\
def main(event, context):
    return {'body': event.get('_body', event.get('order')),
            'type': event['_headers'].get('content-type'), 'path': event['_path']}
"""


def test_kill_9_with_queued_and_running_invocations_loses_none(setup):
    setup.push(
        {
            "slow/sless.yaml": manifest("slow", HTTP, "    async: {concurrency: 2}"),
            "slow/handler.py": SLOW,
        }
    )
    server = setup.serve()
    ids = []
    for n in range(6):
        answer = server.client.post(
            f"{server.base}/async/prod/slow/", json={"n": n, "sleep": 30 if n < 2 else 0.2}
        )
        assert answer.status_code == 202, answer.text
        ids.append(answer.json()["id"])

    def two_running() -> bool:
        listed = server.client.get("/api/v1/invocations", params={"status": "running"}).json()
        return len(listed) == 2

    server.wait(two_running, "two invocations running")
    server.kill()

    again = setup.serve()
    # the two that were running run again (attempt 2, which does not sleep)
    ended = [wait_ended(again, f"/api/invocations/{one}", timeout=120) for one in ids]
    assert [e["status"] for e in ended] == ["succeeded"] * 6
    results = sorted(json.loads(e["response"]["body"])["n"] for e in ended)
    assert results == list(range(6))
    interrupted = [e for e in ended if any(not a["counted"] for a in e["attemptLog"])]
    assert len(interrupted) == 2
    for record in interrupted:
        cut = record["attemptLog"][0]
        assert cut["error"] == "interrupted: the reconciler stopped during this attempt"
        assert record["attemptLog"][-1]["statusCode"] == 200


def test_accepted_invocations_survive_a_kill_right_after_the_202(setup):
    setup.push(
        {
            "slow/sless.yaml": manifest("slow", HTTP, "    async: {concurrency: 1}"),
            "slow/handler.py": SLOW,
        }
    )
    server = setup.serve()
    ids = [
        server.client.post(f"{server.base}/async/prod/slow/", json={"n": n, "sleep": 5}).json()[
            "id"
        ]
        for n in range(20)
    ]
    server.kill()  # at once: one running at most, the rest only accepted
    again = setup.serve()
    listed = again.client.get("/api/v1/invocations", params={"function": "slow"}).json()
    assert sorted(i["id"] for i in listed) == sorted(ids)


def test_ended_invocations_are_collected_after_the_retention(setup):
    setup.push({"slow/sless.yaml": manifest("slow", HTTP), "slow/handler.py": SLOW})
    server = setup.serve(args=["--invocation-retention", "1s"])
    answer = server.client.post(f"{server.base}/async/prod/slow/", json={"n": 1})
    location = answer.headers["location"]
    assert wait_ended(server, location)["status"] == "succeeded"
    # collected within a housekeeping tick (a minute) after the retention: the record goes
    server.wait(
        lambda: server.client.get(location).status_code == 404, "the record to go", timeout=90
    )


def test_a_queue_trigger_fans_out_to_every_subscribed_function(setup):
    trigger = "    triggers: [{type: queue, subject: orders.created}]"
    setup.push(
        {
            "billing/sless.yaml": manifest("billing", trigger),
            "billing/handler.py": ECHO,
            "shipping/sless.yaml": manifest("shipping", trigger),
            "shipping/handler.py": ECHO,
            "other/sless.yaml": manifest(
                "other", "    triggers: [{type: queue, subject: orders.deleted}]"
            ),
            "other/handler.py": ECHO,
        }
    )
    server = setup.serve()
    published = server.client.post(
        "/api/v1/environments/prod/events/orders.created",
        content=b'{"order": 42}',
        headers={**write(server), "Content-Type": "application/json"},
    )
    assert published.status_code == 202, published.text
    made = published.json()["invocations"]
    assert len(made) == 2
    records = [wait_ended(server, f"/api/invocations/{one}") for one in made]
    assert sorted(r["function"] for r in records) == ["billing", "shipping"]
    for record in records:
        assert record["status"] == "succeeded"
        assert record["subject"] == "orders.created"
        body = json.loads(record["response"]["body"])
        assert body["body"] == 42 and body["type"] == "application/json"
    assert server.client.get("/api/v1/invocations", params={"function": "other"}).json() == []
    # publishing needs the API token
    anonymous = server.client.post("/api/v1/environments/prod/events/orders.created")
    assert anonymous.status_code in (401, 403)


def test_metrics_count_the_queue(setup):
    setup.push({"slow/sless.yaml": manifest("slow", HTTP), "slow/handler.py": SLOW})
    server = setup.serve()
    answer = server.client.post(f"{server.base}/async/prod/slow/", json={"n": 1})
    wait_ended(server, answer.headers["location"])

    def counted() -> Any:
        text = server.client.get("/metrics").text
        wanted = 'sless_async_invocations{env="prod",function="slow",status="succeeded"} 1'
        return text if wanted in text else None

    text = server.wait(counted, "the queue's gauges", timeout=30)
    assert 'sless_async_submitted_total{env="prod",function="slow"} 1' in text
    assert 'sless_async_attempts_total{env="prod",function="slow",outcome="succeeded"} 1' in text
    assert 'sless_async_oldest_queued_seconds{env="prod",function="slow"} 0' in text


def test_an_invocation_wakes_a_function_scaled_to_zero(setup):
    fast = ["--scale-window", "3s", "--scale-panic-window", "1s", "--scale-tick", "0.2s"]
    setup.push(
        {
            "sleepy/sless.yaml": manifest("sleepy", HTTP, "    scale: {min: 0, max: 2, idle: 1s}"),
            "sleepy/handler.py": SLOW,
        }
    )
    server = setup.serve(args=fast)
    server.wait(lambda: server.function("sleepy")["phase"] == "Idle", "sleepy idle")
    answer = server.client.post(f"{server.base}/async/prod/sleepy/", json={"n": 4})
    record = wait_ended(server, answer.headers["location"])
    assert record["status"] == "succeeded"
    # one attempt: held while a replica started, never a 502/503 for the cold start
    assert [a["statusCode"] for a in record["attemptLog"]] == [200]
    assert "x-sless-cold-start" in {k.lower() for k, _ in record["response"]["headers"]}
