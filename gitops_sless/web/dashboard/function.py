"""A function's page at ``/functions/{env}/{name}``: its phase, log, build, jobs and calls."""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi.responses import HTMLResponse

from ... import failure
from ...state.store import LOG_TAIL_CHARS
from ..models import FunctionDetail, Invocation, JobRun, Scaling
from ..revisions import revision_list
from . import revisions
from .html import (
    _CALL_COLUMNS,
    _JOB_COLUMNS,
    CHART_CALLS,
    DASH,
    NO_HTML,
    RECENT_CALLS,
    Cell,
    Html,
    _badge,
    _clip,
    _code,
    _error_lines,
    _facts,
    _h,
    _join,
    _log_line,
    _ms,
    _page,
    _section,
    _sha,
    _status_kind,
    _table,
    _tr,
    _url_link,
    _when,
)
from .queue import Queue, section
from .site import Site


class FunctionPage(Site):
    """The page at ``/functions/{env}/{name}``."""

    def function(
        self,
        env: str,
        name: str,
        signout: Html = NO_HTML,
        queue: Queue | None = None,
        csrf: str | None = None,
    ) -> HTMLResponse:
        """``queue``: its asynchronous invocations, read before (QueueReader.read);
        ``csrf``: the session's CSRF token when it may roll back and unpin (else None)."""
        now = time.time()
        header = self.header(self._status(), now, signout)
        row = self.store.function(env, name)
        if row is None:
            main = _h(
                '<nav class="crumbs" aria-label="Breadcrumb"><a href="/">All functions</a></nav>'
                "<h1>No function {name} in {env}</h1><p>A push may have removed it.</p>",
                name=name,
                env=env,
            )
            return _page(f"{name}: not found · gitops-sless", header, main, 404)
        build = self.store.build_of(row)
        jobs = self.store.jobs(env)
        fn = FunctionDetail.from_rows(
            row, build, jobs, self.store.invocations(env, name, CHART_CALLS)
        )
        scaled = self.scaling(env, name) if self.scaling is not None else None
        if scaled:
            fn = fn.model_copy(update={"scaling": Scaling(**scaled)})
        route = self.routes.get(env, name) if self.routes is not None else None
        if route is not None:
            fn = fn.model_copy(
                update={"open_streams": route.load.streams, "open_sockets": route.load.sockets}
            )
        main = _join(
            [
                self._summary(env, fn, row, now),
                revisions.section(
                    revision_list(self.store, self.routes, env, name, self.fn_url),
                    csrf,
                    env == self.reconciler.env,
                ),
                self._log(env, name),
                self._build(fn, now, self._built_with(env, row)),
                self._jobs([job for job in fn.jobs if job.function == name], now),
                section(env, name, queue, now),
                self._calls(env, name, fn.invocations, now),
            ],
            "\n",
        )
        return _page(f"{name}: {fn.phase} · gitops-sless", header, main)

    def refused(
        self, env: str, name: str, message: str, status: int, signout: Html
    ) -> HTMLResponse:
        """What a rollback or an unpin from the page could not do, and the way back."""
        header = self.header(self._status(), time.time(), signout)
        main = _h(
            '<nav class="crumbs" aria-label="Breadcrumb"><a href="/">All functions</a>'
            ' &rsaquo; <a href="/functions/{env}/{name}">{name}</a></nav>'
            '<h1>Not done</h1><p class="notice error">{message}</p>',
            env=env,
            name=name,
            message=message,
        )
        return _page(f"{name}: not done · gitops-sless", header, main, status)

    def _summary(self, env: str, fn: FunctionDetail, row: dict[str, Any], now: float) -> Html:
        revision = _sha(fn.revision)
        commit = self.commits.get(fn.revision)
        if commit:
            revision = _h('{sha} <span class="subject">{s}</span>', sha=revision, s=commit.subject)
        facts: list[tuple[str, Cell]] = [
            ("Environment", env),
            ("Runtime", self._runtime(fn.build_tag) or DASH),
            ("Build", _code(fn.build_tag)),
            ("Revision", revision),
            ("Replicas", self._replicas(env, row)),
            *_scaling(fn),
            *_open(fn),
            ("URL", _url_link(fn.url)),
            ("Manifest", _code(fn.manifest)),
            ("Updated", _when(fn.updated, now)),
            ("Restarts", str(fn.restarts)),
            ("Last exit", fn.last_exit or DASH),
        ]
        failed = fn.build is not None and fn.build.phase == "Failed"
        message = (fn.message or "").strip()
        if failed and fn.build is not None:
            # the log is below, its errors just under: the headline leaves out the
            # installer's own reason, which they show (status shows it on this line)
            message = message.partition("\n")[0]
            said = failure.installer_cause(fn.build.log_tail)
            message = message.removesuffix(f": {said}") if said else message
        return _h(
            '<nav class="crumbs" aria-label="Breadcrumb"><a href="/">All functions</a>'
            " &rsaquo; {env}</nav><h1>{name} {badge}</h1>{message}{problems}{facts}",
            env=env,
            name=fn.name,
            badge=_badge(fn.phase),
            message=_h('<pre class="message">{m}</pre>', m=message) if message else Html(""),
            problems=self._problems(fn) if failed else Html(""),
            facts=_facts(facts),
        )

    def _problems(self, fn: FunctionDetail) -> Html:
        """A failed build's error lines, near the top: readable without scrolling."""
        lines = _error_lines(fn.build.log_tail if fn.build else "")
        if not lines:
            return Html("")
        body = _h('<pre class="log errors">{lines}</pre>', lines="\n".join(lines))
        return _h(
            '<div class="problems">{s}</div>', s=_section("problems", "Why the build failed", body)
        )

    def _built_with(self, env: str, row: dict[str, Any]) -> tuple[str, list[str]]:
        """The folder a build comes from and every function of ``env`` it builds: one build
        (and one log) serves every function a folder declares."""
        manifest = row.get("manifest") or ""
        folder = manifest.rpartition("/")[0] or "."
        tag = row.get("build_tag")
        names = [
            other["name"]
            for other in self.store.functions(env)
            if (other.get("build_tag") == tag if tag else other.get("manifest") == manifest)
        ]
        return folder, names or [row["name"]]

    def _log(self, env: str, name: str) -> Html:
        """The last lines its replicas printed (a traceback shows here, not only in
        ``gitops-sless logs``), error lines marked; the whole log is the logs API's."""
        path = self.store.path.parent / "logs" / env / f"{name}.log"
        lines = _tail(path, LOG_TAIL_LINES)
        more = _h(
            '<p class="muted">The last {n} lines; all of them: <code>gitops-sless logs '
            "{env}/{name}</code>.</p>",
            n=LOG_TAIL_LINES,
            env=env,
            name=name,
        )
        if not lines:
            empty = Html('<p class="muted">Nothing printed yet.</p>')
            return _section("log", "Log", empty)
        body = _h(
            '{more}<pre class="log" id="replica-log" tabindex="0" role="region" '
            'aria-label="Log, last lines">{lines}</pre>',
            more=more,
            lines=_join((_log_line(line) for line in lines), "\n"),
        )
        return _section("log", "Log", body)

    def _build(self, fn: FunctionDetail, now: float, built: tuple[str, list[str]]) -> Html:
        build = fn.build
        if build is None:
            return _section("build", "Build", Html('<p class="muted">Not built.</p>'))
        folder, names = built
        shared = _h(
            '<p class="built-with">Folder <code>{folder}</code> builds {what}{names}.</p>',
            folder=folder,
            what="this function: " if len(names) == 1 else f"{len(names)} functions: ",
            names=_join((_code(name) for name in names), ", "),
        )
        log = build.log_tail
        if len(log) >= LOG_TAIL_CHARS:
            log = log.partition("\n")[2]  # its first line was cut
        lines = _join((_log_line(line) for line in log.rstrip("\n").split("\n")), "\n")
        body = _h(
            '{shared}<p class="muted">Started {started}, finished {finished}.</p>{error}'
            '<pre class="log" id="build-log" tabindex="0" role="region" '
            'aria-label="Build log, last lines">{lines}</pre>',
            shared=shared,
            started=_when(build.started, now),
            finished=_when(build.finished, now),
            error=_h('<p class="error">{e}</p>', e=build.error) if build.error else Html(""),
            lines=lines if log.strip() else "(empty)",
        )
        return _section("build", _h("Build {badge}", badge=_badge(build.phase)), body)

    def _jobs(self, jobs: list[JobRun], now: float) -> Html:
        if not jobs:
            return Html("")
        rows = (
            _tr(
                _JOB_COLUMNS,
                [
                    job.name,
                    str(job.run_id),
                    _badge(job.phase),
                    str(job.attempts),
                    _code(_clip(job.result)) if job.result else _clip(job.error or ""),
                    _when(job.finished, now),
                ],
            )
            for job in jobs
        )
        return _section("jobs", "Jobs", _table(_JOB_COLUMNS, rows))

    def _calls(self, env: str, name: str, calls: list[Invocation], now: float) -> Html:
        if not calls:
            return _section("calls", "Recent calls", Html('<p class="muted">No calls yet.</p>'))
        logs = f"/api/v1/environments/{quote(env)}/functions/{quote(name)}/logs?request="
        rows = (
            _tr(
                _CALL_COLUMNS,
                [
                    _when(call.time, now),
                    call.method,
                    _code(call.path + ("…" if call.path_truncated else "")),
                    _h(
                        '<span class="status {k}">{s}</span>',
                        k=_status_kind(call.status),
                        s=call.status,
                    ),
                    _ms(call.duration_ms),
                    DASH if call.cold_start_ms is None else f"cold, {_ms(call.cold_start_ms)}",
                    self._request(call, logs),
                ],
            )
            for call in calls[:RECENT_CALLS]
        )
        return _section("calls", "Recent calls", Html(_chart(calls) + _table(_CALL_COLUMNS, rows)))

    def _request(self, call: Invocation, logs: str) -> Html:
        """The call's request id, linked to its log lines; and its trace, where a trace
        viewer is known (``--trace-url-template``)."""
        parts = [
            _h(
                '<a href="{href}" data-api title="its log lines"><code>{id}</code></a>',
                href=logs + quote(call.request_id, safe=""),
                id=call.request_id,
            )
        ]
        if self.trace_url and call.method != "CRON":
            url = self.trace_url.replace("{trace_id}", quote(call.trace_id, safe=""))
            parts.append(_h(' · <a href="{href}" rel="noopener">trace</a>', href=url))
        return _join(parts)


LOG_TAIL_LINES = 40
_TAIL_BYTES = 16 * 1024  # enough for 40 lines of a traceback


def _tail(path: Path, count: int) -> list[str]:
    """The last ``count`` whole lines of ``path`` (none when it does not exist)."""
    try:
        with path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - _TAIL_BYTES))
            data = log.read()
    except (FileNotFoundError, NotADirectoryError):
        return []
    lines = data.decode("utf-8", "replace").split("\n")
    if size > _TAIL_BYTES:
        lines = lines[1:]  # its first line was cut
    if lines and lines[-1] == "":
        lines.pop()
    return lines[-count:]


def _chart(calls: list[Invocation]) -> Html:
    """Latency of the last calls as bars, the newest on the right, coloured by status.

    Positions are percentages, so the chart fills any width without stretching its text.
    """
    values = sorted(c.duration_ms for c in calls)
    top = values[-1] or 1.0
    slot = 100 / CHART_CALLS
    first = CHART_CALLS - len(calls)

    def bar(i: int, call: Invocation) -> Html:
        tall = max(1.0, call.duration_ms / top * 85)  # the top 15% holds the scale
        return _h(
            '<rect class="{kind}" x="{x}%" y="{y}%" width="{w}%" height="{tall}%">'
            "<title>{t}</title></rect>",
            kind=_status_kind(call.status),
            x=f"{(first + i) * slot + slot * 0.1:.2f}",
            y=f"{100 - tall:.2f}",
            w=f"{slot * 0.8:.2f}",
            tall=f"{tall:.2f}",
            t=f"{call.method} {call.path} → {call.status} in {_ms(call.duration_ms)}",
        )

    p95 = values[math.ceil(0.95 * len(values)) - 1]
    caption = (
        f"Latency of the last {len(values)} calls, the newest on the right: median "
        f"{_ms(statistics.median(values))}, 95th percentile {_ms(p95)}, max {_ms(top)}."
    )
    return _h(
        '<figure class="chart"><svg role="img" aria-label="{caption}">'
        '<line class="axis" x1="0" y1="100%" x2="100%" y2="100%"></line>'
        '<text class="axis" x="4" y="12">{top}</text>{bars}</svg>'
        "<figcaption>{caption}</figcaption></figure>",
        caption=caption,
        top=_ms(top),
        bars=_join(bar(i, call) for i, call in enumerate(reversed(calls[:CHART_CALLS]))),
    )


def _scaling(fn: FunctionDetail) -> list[tuple[str, Cell]]:
    """The autoscaler's view of an autoscaled function: its policy, load and cold starts."""
    scaled = fn.scaling
    if scaled is None:
        return []
    policy = f"{scaled.min}..{scaled.max} replicas, target {scaled.target} in flight"
    if scaled.min == 0:
        policy += f", idle after {scaled.idle_sec:g}s"
    load = f"{scaled.concurrency:g} in flight (stable average), {scaled.in_flight} now"
    if scaled.waiting:
        load += f", {scaled.waiting} waiting"
    if scaled.panicking:
        load += "; scaling up on a burst"
    cold = DASH
    if scaled.last_cold_start_ms is not None:
        cold = f"last {scaled.last_cold_start_ms:g} ms"
        if scaled.cold_start_p50_ms is not None:
            cold += (
                f"; p50 {scaled.cold_start_p50_ms:g} ms, p95 {scaled.cold_start_p95_ms:g} ms "
                f"over {scaled.cold_starts} in the last hour"
            )
    return [("Scaling", policy), ("Load", load), ("Cold starts", cold)]


def _open(fn: FunctionDetail) -> list[tuple[str, Cell]]:
    """Its streams and WebSockets open now, when it has any."""
    if not (fn.open_streams or fn.open_sockets):
        return []
    parts = [
        f"{count} {what}{'' if count == 1 else 's'}"
        for count, what in ((fn.open_streams, "stream"), (fn.open_sockets, "WebSocket"))
        if count
    ]
    return [("Open now", ", ".join(parts))]
