"""Asynchronous invocations on the dashboard: a function's counts by status and its newest
dead letters with their causes, and a "dead" badge on the overview.

Against a real ``serve`` (SQLite queue, the sandbox), its pages fetched as the browser's
script fetches them (here with the read token as a bearer): the HTML is what is checked.
"""

from __future__ import annotations

import asyncio
import html
import re
from typing import Any

from gitops_sless.invocations import model
from gitops_sless.web.dashboard.queue import SHOWN, QueueReader, section

from ..invocations.test_async_serve import FLAKY
from ..test_serve import HTTP, git_daemon, git_root, http_function, manifest, setup

__all__ = ["git_daemon", "git_root", "setup"]  # the fixtures, shared with test_serve

ASYNC = "    async: {retries: 2, backoff: 1s}"
DIED = "HTTP 500: not yet 3 (after 3 attempts: retries spent)"


def submit(server: Any, ok_from: int) -> str:
    answer = server.client.post(f"{server.base}/async/prod/orders/", json={"ok_from": ok_from})
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def counted(page: str) -> dict[str, str]:
    """The section's counts: status -> number, as shown."""
    block = page.split('<section id="async"', 1)[1].split("</section>", 1)[0]
    return dict(re.findall(r"<dt>(\w+)</dt><dd>(\d+)</dd>", block))


def test_a_function_page_lists_its_dead_letters_with_their_causes_and_the_counts(setup):
    setup.push(
        {
            "orders/sless.yaml": manifest("orders", HTTP, ASYNC),
            "orders/handler.py": FLAKY,
            **http_function("plain", "no queue here"),
        }
    )
    server = setup.serve()
    ok, dead = submit(server, 1), submit(server, 99)

    def shown() -> str | None:
        page = server.client.get("/functions/prod/orders").text
        return page if f'id="dead-{dead}"' in page and ">Succeeded<" in page else None

    page = server.wait(shown, "the dead letter on the function's page", 60)
    assert counted(page) == {
        "Queued": "0",
        "Running": "0",
        "Succeeded": "1",
        "Failed": "0",
        "Dead": "1",
    }
    row = page.split(f'<tr id="dead-{dead}">', 1)[1].split("</tr>", 1)[0]
    assert f'href="/api/v1/invocations/{dead}" data-api' in row
    assert '<td data-label="Attempts">3</td>' in row
    assert f'<td data-label="Cause">{html.escape(DIED)}</td>' in row
    assert "<time datetime=" in row  # when it died
    assert ok not in page  # only the dead are listed
    assert "gitops-sless invocations redrive --dead --env prod --function orders" in page

    overview = server.client.get("/").text
    orders = overview.split('id="fn-prod-orders"', 1)[1].split("</tr>", 1)[0]
    assert "1 dead</span>" in orders
    plain = overview.split('id="fn-prod-plain"', 1)[1].split("</tr>", 1)[0]
    assert " dead</span>" not in plain
    # a function never called asynchronously has no such section
    assert 'id="async"' not in server.client.get("/functions/prod/plain").text

    # redriven, it dies again (FLAKY with ok_from 99): listed once, with six attempts
    headers = {"Authorization": f"Bearer {server.api_token()}"}
    redriven = server.client.post(
        "/api/v1/invocations/redrive", params={"env": "prod", "function": "orders"}, headers=headers
    )
    assert redriven.json() == {"redriven": 1}

    def six() -> str | None:
        page = server.client.get("/functions/prod/orders").text
        return page if '<td data-label="Attempts">6</td>' in page else None

    page = server.wait(six, "the page to show its six attempts", 60)
    assert page.count(f'id="dead-{dead}"') == 1
    assert counted(page)["Dead"] == "1"


# --- the section alone, from a service that is only as much as it needs ---------------------------


class Service:
    """What QueueReader asks of the Invocations service: enabled, counts, list."""

    enabled = True

    def __init__(self, counts: dict[str, int], found: list[model.Invocation] | Exception):
        self._counts = counts
        self.found = found
        self.listed = 0

    def counts(self, env: str, function: str) -> dict[str, int]:
        return dict(self._counts)

    async def list(self, which: model.Filter) -> list[model.Invocation]:
        assert (which.env, which.function, which.status) == ("prod", "orders", "dead")
        self.listed += 1
        if isinstance(self.found, Exception):
            raise self.found
        return self.found


def dead_one(n: int, ended: float, error: str = "HTTP 500: <b>no</b>") -> model.Invocation:
    attempt = model.Attempt(1, ended - 1, ended, 500, "HTTP 500: <b>no</b>")
    return model.Invocation(
        id=f"id{n:04d}",
        env="prod",
        function="orders",
        method="POST",
        path="/",
        headers=(),
        body=b"",
        created=ended - 2,
        status="dead",
        attempts=(attempt,),
        error=error,
        ended=ended,
    )


def counts(**some: int) -> dict[str, int]:
    return {status: some.get(status, 0) for status in model.STATUSES}


def test_the_newest_dead_letters_first_escaped_and_read_again_only_when_counts_change():
    found = [dead_one(n, 1_700_000_000 + (n * 7919) % 100) for n in range(15)]  # any order
    service = Service(counts(dead=15, succeeded=2), found)
    reader = QueueReader(service)  # type: ignore[arg-type]
    queue = asyncio.run(reader.read("prod", "orders"))
    assert queue is not None
    newest = sorted(found, key=lambda inv: inv.ended or 0, reverse=True)[:SHOWN]
    assert [letter.id for letter in queue.dead] == [inv.id for inv in newest]
    text = section("prod", "orders", queue, 1_700_000_200)
    assert "The newest 10 of 15" in text
    assert "HTTP 500: &lt;b&gt;no&lt;/b&gt;" in text and "<b>" not in text

    asyncio.run(reader.read("prod", "orders"))
    assert service.listed == 1  # the same counts: the same list
    service._counts = counts(dead=16, succeeded=2)
    asyncio.run(reader.read("prod", "orders"))
    assert service.listed == 2


def test_a_queue_that_cannot_answer_leaves_the_counts_and_says_why():
    service = Service(counts(dead=2), ConnectionError("nats: no servers available"))
    queue = asyncio.run(QueueReader(service).read("prod", "orders"))  # type: ignore[arg-type]
    assert queue is not None and queue.problem == "nats: no servers available"
    text = section("prod", "orders", queue, 0)
    assert "<dt>Dead</dt><dd>2</dd>" in text
    assert "They cannot be read now: nats: no servers available" in text


def test_no_section_without_asynchronous_invocations_or_without_the_queue():
    assert asyncio.run(QueueReader(None).read("prod", "orders")) is None
    quiet = Service(counts(), [])
    assert asyncio.run(QueueReader(quiet).read("prod", "orders")) is None  # type: ignore[arg-type]
    assert quiet.listed == 0
    busy = Service(counts(queued=3), [])
    queue = asyncio.run(QueueReader(busy).read("prod", "orders"))  # type: ignore[arg-type]
    assert queue is not None and busy.listed == 0  # nothing dead: nothing listed
    assert "Dead letters" not in section("prod", "orders", queue, 0)
    assert section("prod", "orders", None, 0) == ""
