"""The reporter sends statuses and comments in the background, latest report per PR first."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from gitops_sless.errors import ForgeRefused, ForgeUnavailable
from gitops_sless.previews.pulls import PullRequest
from gitops_sless.previews.reporter import PreviewReport, Reporter
from gitops_sless.steps.rollouts import Verdict

from .test_forge import SHA, make_client, serve

CONTEXT = "gitops-sless/preview"
MARKER = "gitops-sless:preview"


class RecordingForge:
    """A Forge that records calls; it can hang (``gate``) or fail the next calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a call is inside the forge
        self.errors: list[Exception] = []  # raised by the next calls, one each
        self.pulls: dict[str, list[int]] = {}  # commit -> the pull requests it belongs to

    def _enter(self, call: tuple) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if self.errors:
            raise self.errors.pop(0)
        self.calls.append(call)

    def open_pulls(self) -> list[PullRequest]:
        return []

    def set_status(
        self, sha: str, state: str, context: str, description: str, url: str | None
    ) -> None:
        self._enter(("status", sha, state, context, description, url))

    def upsert_comment(self, number: int, marker: str, body: str) -> None:
        self._enter(("comment", number, marker, body))

    def pulls_of(self, sha: str) -> list[int]:
        self._enter(("pulls_of", sha))
        return self.pulls.get(sha, [])

    def close(self) -> None:
        pass


@pytest.fixture
def forge() -> RecordingForge:
    return RecordingForge()


@pytest.fixture
def reporter(forge: RecordingForge) -> Iterator[Reporter]:
    made = Reporter(forge, CONTEXT, MARKER, backoff=0.01, max_backoff=0.05)
    yield made
    made.close()


def _sha(n: int) -> str:
    return f"{n:040x}"


def test_reports_are_sent_in_order(forge, reporter):
    for number in (1, 2, 3):
        reporter.report(
            number, _sha(number), "pending", f"building #{number}", None, f"body {number}"
        )
    assert reporter.flush(5)
    assert forge.calls == [
        call
        for n in (1, 2, 3)
        for call in (
            ("status", _sha(n), "pending", CONTEXT, f"building #{n}", None),
            ("comment", n, MARKER, f"body {n}"),
        )
    ]


def test_a_newer_report_replaces_a_waiting_one(forge, reporter):
    forge.gate.clear()
    reporter.report(1, _sha(1), "pending", "building", None, None)
    assert forge.entered.wait(5)  # the worker is inside the forge with PR 1's report
    reporter.report(2, _sha(2), "pending", "queued", None, "queued")
    reporter.report(1, _sha(10), "pending", "building again", None, None)  # PR 1: in flight
    reporter.report(2, _sha(2), "pending", "building", None, "building")
    reporter.report(3, _sha(3), "success", "ready", "https://x/pr-3", None)
    reporter.report(2, _sha(20), "success", "ready", "https://x/pr-2", "ready")
    forge.gate.set()
    assert reporter.flush(5)
    assert forge.calls == [
        ("status", _sha(1), "pending", CONTEXT, "building", None),
        # PR 2 keeps its place in line, with only its latest report
        ("status", _sha(20), "success", CONTEXT, "ready", "https://x/pr-2"),
        ("comment", 2, MARKER, "ready"),
        ("status", _sha(10), "pending", CONTEXT, "building again", None),
        ("status", _sha(3), "success", CONTEXT, "ready", "https://x/pr-3"),
    ]


def test_a_report_already_shown_is_not_sent_again(forge, reporter):
    reporter.report(1, _sha(1), "success", "ready", None, "ready")
    assert reporter.flush(5)
    reporter.report(1, _sha(1), "success", "ready", None, "ready")
    assert reporter.flush(5)
    assert len(forge.calls) == 2
    reporter.report(1, _sha(1), "success", "ready", None, "ready, 2 functions")
    assert reporter.flush(5)
    # only the comment changed: the status is not set again
    assert [call[0] for call in forge.calls] == ["status", "comment", "comment"]
    assert forge.calls[-1] == ("comment", 1, MARKER, "ready, 2 functions")


def returns(calls: Callable[[], object]) -> bool:
    """Whether ``calls`` return while the forge still hangs (a deadlock would never)."""
    done = threading.Event()
    threading.Thread(target=lambda: (calls(), done.set()), daemon=True).start()
    return done.wait(30)


def test_report_never_waits_on_a_hanging_forge(forge, reporter):
    forge.gate.clear()
    reporter.report(1, _sha(1), "pending", "building", None, None)
    assert forge.entered.wait(5)
    # the forge hangs until the gate opens, after these: a report that waited would never
    # return (returns() says so instead of hanging the test)
    assert returns(
        lambda: [
            reporter.report(number, _sha(number), "pending", "building", None, "body")
            for number in range(2, 50)
        ]
    )
    assert not reporter.flush(0.05)  # still stuck behind the hanging call
    forge.gate.set()
    assert reporter.flush(5)
    assert len(forge.calls) == 1 + 2 * 48


def test_an_unavailable_forge_is_retried_later(forge, reporter, caplog):
    forge.errors = [ForgeUnavailable("github API POST /x: 503"), ForgeUnavailable("again")]
    reporter.report(1, _sha(1), "success", "ready", None, "ready")
    assert reporter.flush(5)
    assert forge.calls == [
        ("status", _sha(1), "success", CONTEXT, "ready", None),
        ("comment", 1, MARKER, "ready"),
    ]
    assert "report.retry" in [getattr(r, "event", None) for r in caplog.records]


def test_a_retry_sends_only_what_is_left(forge, reporter):
    def fail_comment_once(number: int, marker: str, body: str) -> None:
        forge.upsert_comment = original  # type: ignore[method-assign]
        raise ForgeUnavailable("comment: 502")

    original = forge.upsert_comment
    forge.upsert_comment = fail_comment_once  # type: ignore[method-assign]
    reporter.report(1, _sha(1), "success", "ready", None, "ready")
    assert reporter.flush(5)
    assert [call[0] for call in forge.calls] == ["status", "comment"]


def test_a_refused_report_is_dropped_and_the_rest_go_on(forge, reporter, caplog):
    caplog.set_level(logging.ERROR)
    forge.errors = [ForgeRefused("github API POST /x: 404 Not Found")]
    reporter.report(1, _sha(1), "success", "ready", None, None)
    reporter.report(2, _sha(2), "success", "ready", None, None)
    assert reporter.flush(5)
    assert [call[1] for call in forge.calls] == [_sha(2)]
    assert "PR #1: ForgeRefused" in caplog.text


def test_close_stops_the_worker_and_later_reports_are_ignored(forge):
    made = Reporter(forge, CONTEXT, MARKER)
    made.close()
    made.report(1, _sha(1), "success", "ready", None, None)
    assert made.flush(1)
    assert forge.calls == []
    assert not made._thread.is_alive()


def test_a_full_queue_drops_the_oldest(forge, caplog):
    forge.gate.clear()
    made = Reporter(forge, CONTEXT, MARKER, max_pending=2)
    made.report(1, _sha(1), "pending", "a", None, None)
    assert forge.entered.wait(5)
    for number in (2, 3, 4):
        made.report(number, _sha(number), "pending", "a", None, None)
    forge.gate.set()
    assert made.flush(5)
    assert [call[1] for call in forge.calls] == [_sha(1), _sha(3), _sha(4)]
    assert "dropped the oldest" in caplog.text
    made.close()


@pytest.mark.parametrize("status", [429, 403])
def test_with_a_rate_limited_forge_report_returns_at_once_and_later_succeeds(status):
    fake, server = serve("github")
    client = make_client(fake, max_wait=0)  # never wait inside the forge: the reporter backs off
    made = Reporter(client, CONTEXT, MARKER, backoff=0.2)
    try:
        limit = {"Retry-After": "1"} if status == 429 else {"X-RateLimit-Remaining": "0"}
        limit.setdefault("X-RateLimit-Reset", str(int(time.time()) + 1))
        for _ in range(2):
            fake.fail("POST", "/statuses/", status, limit)
        fake.gate = threading.Event()  # the forge hangs until the gate opens
        # the forge hangs until the gate opens, which is after both reports returned
        assert returns(
            lambda: (
                made.report(5, SHA, "pending", "building", None, "building"),
                made.report(5, SHA, "success", "ready", "https://sless.example/pr-5", "ready"),
            )
        )
        fake.gate.set()
        assert made.flush(10)
        statuses = [body["state"] for _, body in fake.statuses]
        assert statuses[-1] == "success"
        assert [c["body"] for c in fake.comments[5]] == [f"<!-- {MARKER} -->\nready"]
    finally:
        made.close()
        client.close()
        server.shutdown()
        server.server_close()


def test_a_bad_argument_never_raises_from_report(caplog):
    fake, server = serve("gitea")
    client = make_client(fake)
    made = Reporter(client, CONTEXT, MARKER)
    try:
        made.report(1, "not a sha", "success", "ready", None, None)
        made.report(2, SHA, "done", "ready", None, None)
        assert made.flush(5)
        assert fake.calls == []
        assert "not a hexadecimal sha" in caplog.text and "use one of" in caplog.text
    finally:
        made.close()
        client.close()
        server.shutdown()
        server.server_close()


def test_a_preview_report_goes_out_as_a_status_and_the_comment(forge, reporter):
    """What previews hand the reporter: its state, names and links, nothing a function said."""
    report = PreviewReport(
        env="pr-5",
        sha=_sha(5),
        state="Failed",
        url="https://sless.example/fn/pr-5/",
        functions=(("greet", "Ready", "https://sless.example/fn/pr-5/greet/"),),
        failures=("job notes-create-table failed",),
    )
    reporter.report_preview(5, report)
    assert reporter.flush(5)
    assert forge.calls == [
        (
            "status",
            _sha(5),
            "failure",
            CONTEXT,
            "preview failed: job notes-create-table failed",
            "https://sless.example/fn/pr-5/",
        ),
        ("comment", 5, MARKER, report.comment),
    ]


ROLLOUT_CONTEXT = f"{CONTEXT}/rollout/prod/greet"
ROLLOUT_MARKER = f"{MARKER}:rollout/prod/greet"
NUMBERS = "greet r4 rolled back at step 1 of 3 (10%): 7 of 20 calls failed (35.0%, at most 5.0%)"


def verdict(phase: str, said: str, commit: str = _sha(4)) -> Verdict:
    return Verdict("prod", "greet", "r4", "r3", commit, phase, said)


def test_a_rollout_is_its_commits_status_under_a_context_of_its_own(forge, reporter):
    reporter.report_rollout(verdict("Progressing", "rollout of greet r4: 10% (step 1 of 3)"))
    assert reporter.flush(5)
    reporter.report_rollout(verdict("Promoted", "greet r4 promoted after step 2 of 3 (50%)"))
    assert reporter.flush(5)
    assert [call[1:5] for call in forge.calls] == [
        (_sha(4), "pending", ROLLOUT_CONTEXT, "rollout of greet r4: 10% (step 1 of 3)"),
        (_sha(4), "success", ROLLOUT_CONTEXT, "greet r4 promoted after step 2 of 3 (50%)"),
    ]


def test_a_withdrawn_rollout_leaves_its_commit_in_error_not_pending(forge, reporter):
    said = "greet r4 withdrawn before a verdict: replaced by r5"
    reporter.report_rollout(verdict("Progressing", "rollout of greet r4: 10% (step 1 of 3)"))
    assert reporter.flush(5)
    reporter.report_rollout(verdict("Withdrawn", said))
    assert reporter.flush(5)
    assert [call[1:5] for call in forge.calls] == [
        (_sha(4), "pending", ROLLOUT_CONTEXT, "rollout of greet r4: 10% (step 1 of 3)"),
        (_sha(4), "error", ROLLOUT_CONTEXT, said),
    ]


def test_a_rolled_back_candidate_fails_its_status_and_says_so_on_its_pull_requests(forge, reporter):
    forge.pulls[_sha(4)] = [12, 15]
    reporter.report_rollout(verdict("RolledBack", NUMBERS))
    assert reporter.flush(5)
    assert forge.calls[:2] == [
        ("status", _sha(4), "failure", ROLLOUT_CONTEXT, NUMBERS, None),
        ("pulls_of", _sha(4)),
    ]
    comments = forge.calls[2:]
    assert [(c[0], c[1], c[2]) for c in comments] == [
        ("comment", 12, ROLLOUT_MARKER),
        ("comment", 15, ROLLOUT_MARKER),
    ]
    assert NUMBERS in comments[0][3] and "r3 takes every call" in comments[0][3]


def test_a_commit_pushed_directly_gets_the_status_alone(forge, reporter):
    reporter.report_rollout(verdict("RolledBack", NUMBERS))
    assert reporter.flush(5)
    assert [call[0] for call in forge.calls] == ["status", "pulls_of"]


def test_a_newer_commits_rollout_never_replaces_an_older_commits_verdict(forge, reporter):
    forge.gate.clear()
    reporter.report(1, _sha(1), "pending", "building", None, None)
    assert forge.entered.wait(5)  # the worker is busy: the rest wait in line
    reporter.report_rollout(verdict("Progressing", "rollout of greet r4", _sha(4)))
    reporter.report_rollout(verdict("RolledBack", NUMBERS, _sha(4)))  # replaces its start
    reporter.report_rollout(verdict("Progressing", "rollout of greet r5", _sha(5)))
    forge.gate.set()
    assert reporter.flush(5)
    assert [(c[1], c[2]) for c in forge.calls if c[0] == "status"] == [
        (_sha(1), "pending"),
        (_sha(4), "failure"),
        (_sha(5), "pending"),
    ]


def test_a_rolled_back_verdict_waits_out_an_unavailable_forge(forge, reporter):
    forge.pulls[_sha(4)] = [12]
    forge.errors = [ForgeUnavailable("github API POST /x: 503"), ForgeUnavailable("again")]
    reporter.report_rollout(verdict("RolledBack", NUMBERS))
    assert reporter.flush(5)
    assert [call[:2] for call in forge.calls] == [
        ("status", _sha(4)),
        ("pulls_of", _sha(4)),
        ("comment", 12),
    ]
