"""OpenTelemetry export of reconcile passes (issue 31): ``serve --otlp-endpoint`` sends
one trace per pass to a real OTLP/HTTP receiver (protobuf decoded with the
``opentelemetry-proto`` package), its spans parented as the pass ran: ``sync`` at the
root, ``fetch``, ``plan``, ``apply`` and ``prune`` under it, and each build and job run
under the pass that started it, however long it took. Without the flag, nothing is sent
and the SDK is never imported."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from .otlp_receiver import OtlpReceiver, Span
from .test_serve import HTTP, git_daemon, git_root, http_function, manifest, setup  # noqa: F401

BROKEN = "def main(event):\n    return 1\n"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "sless-under-test"}


def children(spans: list[Span], parent: Span) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id and s.trace_id == parent.trace_id]


def passes_that_deployed(spans: list[Span]) -> list[Span]:
    """Root ``sync`` spans whose pass applied something, with the builds under them."""
    found = []
    for root in (s for s in spans if s.name == "sync" and not s.parent_id):
        names = [c.name for c in children(spans, root)]
        if "build" in names:
            found.append(root)
    return found


def test_every_pass_is_a_trace_with_its_steps_and_builds_as_children(setup):  # noqa: F811
    receiver = OtlpReceiver()
    try:
        setup.push(http_function("greet", "v1"))
        server = setup.serve(args=["--otlp-endpoint", receiver.url], env=FAST_EXPORT)
        assert server.call("greet", "/").status_code == 200

        (first,) = receiver.wait(passes_that_deployed, "the pass that built greet")
        assert first.service == "sless-under-test"
        assert first.attributes["sless.environment"] == "prod"
        spans = receiver.spans
        under = children(spans, first)
        names = {s.name for s in under}
        assert {"fetch", "plan", "apply", "prune", "build"} <= names, names
        (build,) = [s for s in under if s.name == "build"]
        assert build.attributes["sless.result"] == "Succeeded" and not build.error
        assert build.attributes["sless.runtime"] == "python3.11"
        assert first.start_ns <= build.start_ns
        assert all(s.trace_id == first.trace_id for s in under)
        assert receiver.paths and set(receiver.paths) == {"/v1/traces"}

        # a build that fails is a failed span, in the trace of the pass that started it
        setup.push(
            {
                "bad/sless.yaml": manifest("bad", HTTP),
                "bad/requirements.txt": "no-such-package-sless==0\n",
                "bad/handler.py": BROKEN,
            }
        )
        server.sync()

        def failed_build(found: list[Span]) -> list[Span]:
            return [s for s in found if s.name == "build" and s.error]

        (broken,) = receiver.wait(failed_build, "a failed build span", 120)
        assert broken.attributes["sless.result"] == "Failed"
        root = next(s for s in receiver.spans if s.span_id == broken.parent_id)
        assert root.name == "sync" and not root.parent_id
    finally:
        receiver.close()


def test_without_an_endpoint_the_sdk_is_not_even_imported():
    code = (
        "import sys\n"
        "from gitops_sless import telemetry\n"
        "with telemetry.span('sync', {'a': 1}) as s:\n"
        "    s.set_attribute('b', 2); s.failed('no')\n"
        "assert telemetry.current() is None and not telemetry.enabled()\n"
        "from gitops_sless import reconciler, cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


TRACED = """\
def main(event, context):
    return {"traceparent": context.traceparent}
"""
CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_every_call_is_a_span_the_function_is_a_child_of(setup):  # noqa: F811
    receiver = OtlpReceiver()
    try:
        setup.push({"traced/sless.yaml": manifest("traced", HTTP), "traced/handler.py": TRACED})
        server = setup.serve(args=["--otlp-endpoint", receiver.url], env=FAST_EXPORT)
        # under the caller's span: the function's parent is the proxy's span
        reply = server.call("traced", "/x", headers={"traceparent": CALLER})
        assert reply.status_code == 200, reply.text
        got = reply.json()["traceparent"]
        assert got[3:35] == CALLER[3:35] and got[36:52] != CALLER[36:52]

        def proxy_span(spans: list[Span]) -> list[Span]:
            return [s for s in spans if s.name == "GET /fn/prod/traced"]

        (span,) = receiver.wait(proxy_span, "the call's span")
        assert (span.trace_id, span.parent_id) == (CALLER[3:35], CALLER[36:52])
        assert span.span_id == got[36:52]
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["sless.function"] == "traced"
        assert span.attributes["sless.environment"] == "prod"
        assert span.attributes["sless.cold_start"] is False and not span.error
        assert span.attributes["sless.revision"] == "r1"

        # no trace sent: the call's span is the root of a new one, named by the request id
        fresh = server.call("traced", "/y")
        started = fresh.json()["traceparent"]
        assert started[3:35] == fresh.headers["x-request-id"]

        def root(spans: list[Span]) -> list[Span]:
            return [s for s in proxy_span(spans) if s.trace_id == started[3:35]]

        (first,) = receiver.wait(root, "the new trace's span")
        assert first.parent_id == "" and first.span_id == started[36:52]

        # a caller that does not sample: nothing exported for its call
        unsampled = CALLER[:-2] + "00"
        assert server.call("traced", "/z", headers={"traceparent": unsampled}).status_code == 200
        server.call("traced", "/after")  # sampled: exported after the unsampled one
        receiver.wait(lambda spans: len(proxy_span(spans)) >= 3, "three spans")
        assert len(proxy_span(receiver.spans)) == 3
    finally:
        receiver.close()


JOB_CODE = """\
def main(event, context):
    return {"traceparent": context.traceparent}
"""
JOB_MANIFEST = """\
functions:
  - name: nightly
    runtime: python3.11
    entrypoint: handler.main
    jobs:
      - {name: backfill, runId: 1, event: {}}
"""


def test_a_job_run_is_traced_under_its_span(setup):  # noqa: F811
    receiver = OtlpReceiver()
    try:
        setup.push({"nightly/sless.yaml": JOB_MANIFEST, "nightly/handler.py": JOB_CODE})
        server = setup.serve(args=["--otlp-endpoint", receiver.url], env=FAST_EXPORT)

        def finished() -> list[dict]:
            return [r for r in server.jobs() if r["name"] == "backfill" and r["result"]]

        (run,) = server.wait(finished, "the job's result")
        traceparent = json.loads(run["result"])["traceparent"]

        def job_spans(spans: list[Span]) -> list[Span]:
            return [s for s in spans if s.name == "job"]

        (job,) = receiver.wait(job_spans, "the job's span")
        # the run's handler is in the job span's trace, the job span its parent
        assert traceparent[3:35] == job.trace_id and traceparent[36:52] == job.span_id
        assert job.attributes["sless.job"] == "backfill"
        assert f"trace {job.trace_id}" in server.output()
    finally:
        receiver.close()


def test_without_export_a_job_run_still_has_a_trace_of_its_own(setup):  # noqa: F811
    setup.push({"nightly/sless.yaml": JOB_MANIFEST, "nightly/handler.py": JOB_CODE})
    server = setup.serve()
    (run,) = server.wait(lambda: [r for r in server.jobs() if r["result"]], "the job's result")
    traceparent = json.loads(run["result"])["traceparent"]
    # the same trace the reconciler's log names for the run
    assert f"backfill run 1, attempt 1, trace {traceparent[3:35]}" in server.output()


SPAN = {
    "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
    "spanId": "00f067aa0ba902b7",
    "startTimeUnixNano": "1",
    "endTimeUnixNano": "2",
}
OWN_SPAN = """\
def main(event, context):
    print("serving", event["_path"])
    if event["_path"] == "/fail":
        raise RuntimeError("no")
    return context.trace_headers()
"""


def test_the_functions_own_span_is_exported_on_its_behalf(setup):  # noqa: F811
    receiver = OtlpReceiver()
    try:
        setup.push({"own/sless.yaml": manifest("own", HTTP), "own/handler.py": OWN_SPAN})
        server = setup.serve(args=["--otlp-endpoint", receiver.url], env=FAST_EXPORT)
        reply = server.call("own", "/x", headers={"traceparent": CALLER})
        assert reply.status_code == 200, reply.text
        onward = reply.json()["traceparent"]  # what a call the handler makes carries

        def function_spans(spans: list[Span]) -> list[Span]:
            return [s for s in spans if s.service == "prod/own"]

        (own,) = receiver.wait(function_spans, "the function's span")
        (proxy,) = [s for s in receiver.spans if s.name == "GET /fn/prod/own"]
        # caller -> the proxy's span -> the function's span -> what the function calls
        assert proxy.parent_id == CALLER[36:52]
        assert (own.trace_id, own.parent_id) == (CALLER[3:35], proxy.span_id)
        assert onward[3:35] == own.trace_id and onward[36:52] == own.span_id
        assert own.attributes["faas.invocation_id"] == reply.headers["x-request-id"]
        assert own.attributes["faas.name"] == "own" and not own.error
        # the same trace in the function's log line, beside the request id
        log = server.state_dir / "logs" / "prod" / "own.log"
        tag = f"[request_id={reply.headers['x-request-id']} trace_id={CALLER[3:35]}] serving /x"
        server.wait(lambda: tag in log.read_text(), "the call's tagged log line")

        failed = server.call("own", "/fail")
        assert failed.status_code == 500

        def failed_spans(spans: list[Span]) -> list[Span]:
            return [s for s in function_spans(spans) if s.error]

        (bad,) = receiver.wait(failed_spans, "the failed call's span")
        assert bad.trace_id == failed.headers["x-request-id"]

        # the relay takes spans from replicas only: a guessed key, or none, is refused
        forged = {"resourceSpans": [{"scopeSpans": [{"spans": [dict(SPAN, name="forged")]}]}]}
        relay = f"{server.base}/internal/otlp/v1/traces"
        for headers in ({"authorization": "Bearer guessed"}, {}):
            assert httpx.post(relay, json=forged, headers=headers).status_code == 401
        server.call("own", "/after")
        receiver.wait(lambda spans: len(function_spans(spans)) >= 3, "the next call's span")
        assert "forged" not in {s.name for s in receiver.spans}
    finally:
        receiver.close()


def test_an_async_invocation_is_a_submission_span_with_its_attempts_under_it(setup):  # noqa: F811
    from .invocations.test_async_serve import ASYNC, TRACED, wait_ended

    receiver = OtlpReceiver()
    try:
        setup.push(
            {"traced/sless.yaml": manifest("traced", HTTP, ASYNC), "traced/handler.py": TRACED}
        )
        server = setup.serve(args=["--otlp-endpoint", receiver.url], env=FAST_EXPORT)
        answer = server.call(
            "traced",
            "/",
            method="POST",
            json={},
            headers={"Prefer": "respond-async", "traceparent": CALLER},
        )
        assert answer.status_code == 202, answer.text
        assert wait_ended(server, answer.headers["location"])["status"] == "succeeded"

        def tree(spans: list[Span]) -> list[Span]:
            return [s for s in spans if s.trace_id == CALLER[3:35]]

        receiver.wait(
            lambda spans: len([s for s in tree(spans) if s.service == "prod/traced"]) >= 2,
            "both attempts' function spans",
        )
        spans = tree(receiver.spans)
        (submission,) = [s for s in spans if s.name == "POST /async/prod/traced"]
        assert submission.parent_id == CALLER[36:52]
        attempts = sorted((s for s in spans if s.name.startswith("attempt ")), key=lambda s: s.name)
        assert [s.name for s in attempts] == ["attempt 1 prod/traced", "attempt 2 prod/traced"]
        assert all(a.parent_id == submission.span_id for a in attempts)
        assert attempts[0].error and not attempts[1].error  # the first answered 500
        # each attempt's call through the proxy is under it, the function under that
        calls = [s for s in spans if s.name == "POST /fn/prod/traced"]
        assert sorted(c.parent_id for c in calls) == sorted(a.span_id for a in attempts)
    finally:
        receiver.close()
