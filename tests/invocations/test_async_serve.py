"""Asynchronous invocations end to end: a real ``gitops-sless serve`` (SQLite queue, the
sandbox), real functions, the API a user reads."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx

from ..test_serve import HTTP, git_daemon, git_root, manifest, setup

__all__ = ["git_daemon", "git_root", "setup"]  # the fixtures, shared with test_serve

# fails with a 500 until its attempt number reaches `ok_from` (from the header the worker
# adds), then answers with what it received
FLAKY = """\
def main(event, context):
    attempt = int(event['_headers'].get('x-invocation-attempt', '0'))
    if attempt < int(event.get('ok_from', 1)):
        return {'statusCode': 500, 'body': 'not yet %d' % attempt}
    return {'attempt': attempt, 'path': event['_path'], 'query': event['_query'],
            'id': event['_headers'].get('x-invocation-id'), 'order': event.get('order')}
"""

REFUSE = """\
def main(event, context):
    return {'statusCode': 422, 'body': 'order has no lines'}
"""

ASYNC = "    async: {retries: 2, backoff: 1s}"


def repo() -> dict[str, str]:
    return {
        "orders/sless.yaml": manifest("orders", HTTP, ASYNC),
        "orders/handler.py": FLAKY,
        "strict/sless.yaml": manifest("strict", HTTP, ASYNC),
        "strict/handler.py": REFUSE,
    }


def write(server: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_token()}"}


def wait_ended(server: Any, location: str, timeout: float = 60) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        found = server.client.get(location).json()
        return found if found["status"] in ("succeeded", "failed", "dead") else None

    return server.wait(ended, f"{location} to end", timeout)


def test_202_then_the_result_after_retries_with_backoff(setup):
    setup.push(repo())
    server = setup.serve()
    answer = server.call(
        "orders",
        "/new?x=1",
        method="POST",
        json={"ok_from": 3, "order": 7},
        headers={"Prefer": "respond-async"},
    )
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert body["status"] == "queued"
    assert answer.headers["location"] == f"/api/invocations/{body['id']}"

    record = wait_ended(server, answer.headers["location"])
    assert record["status"] == "succeeded", record
    attempts = record["attemptLog"]
    assert [a["statusCode"] for a in attempts] == [500, 500, 200]
    assert attempts[0]["error"] == "HTTP 500: not yet 1"
    # backoff observed: 1 s, then 2 s (plus jitter), between the attempts' starts
    starts = [time.mktime(time.strptime(a["started"][:19], "%Y-%m-%dT%H:%M:%S")) for a in attempts]
    assert starts[1] - starts[0] >= 1 - 1  # whole seconds: at least the backoff, rounded down
    result = json.loads(record["response"]["body"])
    assert result == {
        "attempt": 3,
        "path": "/new",
        "query": {"x": "1"},
        "id": body["id"],
        "order": 7,
    }
    # the same record under the versioned API
    same = server.client.get(f"/api/v1/invocations/{body['id']}").json()
    assert same["status"] == "succeeded"


def test_async_path_for_callers_without_headers_and_4xx_is_final(setup):
    setup.push(repo())
    server = setup.serve()
    answer = server.client.post(f"{server.base}/async/prod/strict/", json={"lines": []})
    assert answer.status_code == 202, answer.text
    record = wait_ended(server, answer.headers["location"])
    assert record["status"] == "failed"
    assert record["error"] == "HTTP 422: order has no lines"
    assert len(record["attemptLog"]) == 1


def test_unknown_function_is_404_never_202(setup):
    setup.push(repo())
    server = setup.serve()
    for url in ("/fn/prod/nobody/", "/async/prod/nobody/"):
        answer = server.client.post(
            f"{server.base}{url}", content=b"x", headers={"Prefer": "respond-async"}
        )
        assert answer.status_code == 404, answer.text
    assert server.client.get("/api/v1/invocations").json() == []


def test_dead_after_retries_then_redrive_one_and_in_bulk(setup):
    setup.push(repo())
    server = setup.serve()
    ids = []
    for _ in range(2):
        answer = server.client.post(f"{server.base}/async/prod/orders/", json={"ok_from": 4})
        ids.append(answer.json()["id"])
    for one in ids:
        record = wait_ended(server, f"/api/invocations/{one}")
        assert record["status"] == "dead"
        assert record["error"].endswith("(after 3 attempts: retries spent)")
    dead = server.client.get(
        "/api/v1/invocations", params={"function": "orders", "status": "dead"}
    ).json()
    assert sorted(d["id"] for d in dead) == sorted(ids)

    # a new round of attempts: attempt 4 succeeds (ok_from 4)
    redriven = server.client.post(f"/api/v1/invocations/{ids[0]}/redrive", headers=write(server))
    assert redriven.status_code == 200, redriven.text
    assert redriven.json()["status"] == "queued"
    record = wait_ended(server, f"/api/invocations/{ids[0]}")
    assert record["status"] == "succeeded"
    assert len(record["attemptLog"]) == 4

    bulk = server.client.post(
        "/api/v1/invocations/redrive",
        params={"env": "prod", "function": "orders"},
        headers=write(server),
    )
    assert bulk.json() == {"redriven": 1}
    assert wait_ended(server, f"/api/invocations/{ids[1]}")["status"] == "succeeded"
    # redriving one that is not dead is refused
    again = server.client.post(f"/api/v1/invocations/{ids[1]}/redrive", headers=write(server))
    assert again.status_code == 409


def test_idempotency_key_gives_the_same_invocation(setup):
    setup.push(repo())
    server = setup.serve()
    headers = {"Idempotency-Key": "order-7", "Prefer": "respond-async"}
    first = server.call("orders", method="POST", json={"order": 7}, headers=headers)
    second = server.call("orders", method="POST", json={"order": 7}, headers=headers)
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    other = server.call(
        "orders", method="POST", json={}, headers={**headers, "Idempotency-Key": "order-8"}
    )
    assert other.json()["id"] != first.json()["id"]


def test_reads_need_the_read_token(setup):
    setup.push(repo())
    server = setup.serve()
    answer = server.client.post(f"{server.base}/async/prod/orders/", json={})
    location = answer.headers["location"]
    anonymous = httpx.get(f"{server.base}{location}")
    assert anonymous.status_code == 401
    assert httpx.get(f"{server.base}/api/v1/invocations").status_code == 401
    # a redrive needs the API token: the read token is refused
    refused = httpx.post(
        f"{server.base}{location}/redrive",
        headers={"Authorization": f"Bearer {server.read_token}"},
    )
    assert refused.status_code == 403


class Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[dict[str, str], bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        Receiver.received.append((dict(self.headers.items()), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_callback_signed_and_private_addresses_refused(setup, tmp_path):
    from gitops_sless.invocations.callbacks import verify

    receiver = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    secrets = tmp_path / "secrets"
    (secrets / "sless-callbacks").mkdir(parents=True)
    (secrets / "sless-callbacks" / "prod").write_text("s3cret\n")
    try:
        setup.push(repo())
        callback = f"http://127.0.0.1:{receiver.server_address[1]}/done"
        refused = setup.serve(secrets_dir=secrets)
        answer = refused.call(
            "orders",
            method="POST",
            json={},
            headers={"Prefer": "respond-async", "X-Callback-Url": callback},
        )
        assert answer.status_code == 400
        assert "127.0.0.1" in answer.json()["error"] and "refused" in answer.json()["error"]
        refused.stop()

        server = setup.serve(secrets_dir=secrets, args=["--callback-allow", "127.0.0.1/32"])
        answer = server.call(
            "orders",
            method="POST",
            json={"order": 9},
            headers={"Prefer": "respond-async", "X-Callback-Url": callback},
        )
        assert answer.status_code == 202, answer.text
        server.wait(lambda: Receiver.received, "the callback")
        headers, body = Receiver.received[0]
        headers = {k.lower(): v for k, v in headers.items()}
        assert headers["x-call-id"] == answer.json()["id"]
        assert headers["x-function-status"] == "200"
        assert headers["x-invocation-status"] == "succeeded"
        assert json.loads(body)["order"] == 9
        assert verify(body, headers["x-signature"], b"s3cret")
        assert not verify(body, headers["x-signature"], b"another")
    finally:
        receiver.shutdown()
        receiver.server_close()


NODE = """\
module.exports.handler = async (event) => ({
  attempt: event._headers['x-invocation-attempt'], name: event.name,
});
"""


def test_a_nodejs_function_runs_asynchronously_submitted_or_published(setup):
    setup.push(
        {
            "hello/sless.yaml": "\n".join(
                [
                    "functions:",
                    "  - name: hello-js",
                    "    runtime: nodejs20",
                    "    entrypoint: hello.handler",
                    "    triggers: [{type: http}, {type: queue, subject: greet}]",
                    "",
                ]
            ),
            "hello/hello.js": NODE,
        }
    )
    server = setup.serve()
    answer = server.client.post(f"{server.base}/async/prod/hello-js/", json={"name": "Ada"})
    record = wait_ended(server, answer.headers["location"])
    assert record["status"] == "succeeded", record
    assert json.loads(record["response"]["body"]) == {"attempt": "1", "name": "Ada"}
    # an event has no Host of its own: Node refuses HTTP/1.1 without one
    published = server.client.post(
        "/api/v1/environments/prod/events/greet",
        content=b'{"name": "Bo"}',
        headers={**write(server), "Content-Type": "application/json"},
    )
    (made,) = published.json()["invocations"]
    record = wait_ended(server, f"/api/invocations/{made}")
    assert record["status"] == "succeeded", record
    assert json.loads(record["response"]["body"])["name"] == "Bo"


# the first attempt fails naming the trace context it got, the second answers with it
TRACED = """\
def main(event, context):
    attempt = int(event['_headers'].get('x-invocation-attempt', '0'))
    seen = {'traceparent': context.traceparent,
            'tracestate': event['_headers'].get('tracestate')}
    if attempt < 2:
        return {'statusCode': 500, 'body': seen['traceparent']}
    return seen
"""
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_each_attempt_is_a_child_of_its_submission_in_the_callers_trace(setup):
    setup.push({"traced/sless.yaml": manifest("traced", HTTP, ASYNC), "traced/handler.py": TRACED})
    server = setup.serve()

    def attempts(headers: dict[str, str]) -> list[str]:
        answer = server.call(
            "traced", "/", method="POST", json={}, headers={"Prefer": "respond-async", **headers}
        )
        assert answer.status_code == 202, answer.text
        record = wait_ended(server, answer.headers["location"])
        assert record["status"] == "succeeded", record
        first = record["attemptLog"][0]["error"].removeprefix("HTTP 500: ")
        second = json.loads(record["response"]["body"])
        return [first, second["traceparent"], second["tracestate"]]

    first, second, state = attempts({"traceparent": PARENT, "tracestate": "vendor=7"})
    for seen in (first, second):
        version, trace_id, parent, flags = seen.split("-")
        assert (version, trace_id, flags) == ("00", "4bf92f3577b34da6a3ce929d0e0e4736", "01")
        assert parent != "00f067aa0ba902b7"  # the attempt's own span, under the submission
    assert first.split("-")[2] != second.split("-")[2]
    assert state == "vendor=7"

    # no trace sent: the submission starts one, and both attempts are in it
    first, second, state = attempts({})
    assert first[3:35] == second[3:35] and first[36:52] != second[36:52]
    assert state is None
