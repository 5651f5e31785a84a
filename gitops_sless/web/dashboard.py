"""The dashboard: server-rendered pages at ``/`` and ``/functions/{env}/{name}``.

Everything on a page comes from the status store, read through the API's
models (so the page and ``/api/v1`` never disagree, and the store never holds
a secret value), plus a commit's subject and author, read from the mirror's
git objects. Every value passes through ``_h``: a field is escaped unless it
is already ``Html``. A page loads one stylesheet and one script from
``static/`` and nothing else; its Content-Security-Policy allows no other
source and no inline script, so a missed escape still could not run one. The
script fetches the page again every few seconds and patches what changed in
place: a push shows up on an open page, and focus stays where it was.

When the server has a token, a signed-out visitor of any page is shown the
sign-in form instead (by :class:`access.ReadGate`, with a 401); posting a token
to ``/signin`` sets the session cookie and goes back to the page, and the
header's "Sign out" button ends the session. The sign-in page's script fills
the form from a ``#token=`` fragment (the start-up banner's link: a fragment
never reaches the server, nor its logs) and sends it. The session reads the
pages, not ``/api/``: the sign-out form carries the session's CSRF token, which
the dashboard's script sends as :data:`access.CSRF_HEADER` for the API links.
"""

from __future__ import annotations

import hashlib
import html
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pygit2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pygit2.enums import RepositoryOpenFlag
from starlette.requests import ClientDisconnect

from ..previews.prlinks import pull_request_link
from ..state.store import LOG_TAIL_CHARS, MAX_SYNCS, Store
from .access import COOKIE, CSRF_HEADER, Access, Level
from .models import Environment, FunctionDetail, Invocation, JobRun, Preview, Status, Sync

__all__ = ["ASSETS", "REFRESH_MS", "Commit", "Commits", "router", "signin_page"]

ASSETS = "/dashboard/assets"
REFRESH_MS = 2500  # how often an open page fetches itself again
RECENT_SYNCS = 20
RECENT_CALLS = 20
CHART_CALLS = 60
MAX_FORM_BYTES = 8 << 10  # the sign-in form: a token and the page to go back to
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    # the sign-in and sign-out forms are checked by their Origin, which a browser sends
    # as "null" under no-referrer; other sites still get no referrer
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_ERROR_LINE = re.compile(
    r"(?i)\b(?:error|fatal|failed|exception|traceback|cannot|could not|no matching"
    r"|not found|denied|timed out|killed)\b|npm err!"
)
_KIND = {
    "Ready": "ok",
    "Succeeded": "ok",
    "Failed": "bad",
    "Invalid": "warn",
    "Degraded": "bad",
    "Progressing": "busy",
    "Building": "busy",
    "Running": "busy",
    "Pending": "wait",
}
_MARK = {"ok": "✓", "bad": "✕", "warn": "!", "busy": "↻", "wait": "…", "off": "○"}
_FUNCTION_COLUMNS = ("Function", "Phase", "Runtime", "Build", "Revision", "Replicas", "URL")
_SYNC_COLUMNS = (
    "Pass",
    "Environment",
    "Started",
    "Trigger",
    "Revision",
    "Result",
    "Passes",
    "Error",
)
_JOB_COLUMNS = ("Job", "runId", "Phase", "Attempts", "Result or error", "Finished")
_CALL_COLUMNS = ("Time", "Method", "Path", "Status", "Latency")


# --- markup -----------------------------------------------------------------------------


class Html(str):
    """Markup: text that is already escaped."""


def _h(template: str, **fields: object) -> Html:
    """``template`` with each ``{field}`` filled: ``Html`` as is, anything else escaped."""
    escaped = {k: v if isinstance(v, Html) else html.escape(str(v)) for k, v in fields.items()}
    return Html(template.format_map(escaped))


def _join(parts: Iterable[Html], sep: str = "") -> Html:
    return Html(sep.join(parts))


DASH = Html("—")
NO_HTML = Html("")
Cell = Html | str


def _tr(columns: Sequence[str], cells: Sequence[Cell], attrs: Html | None = None) -> Html:
    """A row whose first cell heads it; every cell labelled for the narrow layout."""
    head = _h('<th scope="row" data-label="{k}">{v}</th>', k=columns[0], v=cells[0])
    rest = (
        _h('<td data-label="{k}">{v}</td>', k=k, v=v)
        for k, v in zip(columns[1:], cells[1:], strict=True)
    )
    return _h("<tr{attrs}>{head}{rest}</tr>", attrs=attrs or Html(""), head=head, rest=_join(rest))


def _table(columns: Sequence[str], rows: Iterable[Html]) -> Html:
    head = _join(_h('<th scope="col">{c}</th>', c=c) for c in columns)
    return _h(
        '<table class="cards"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>',
        head=head,
        rows=_join(rows),
    )


def _section(ident: str, title: Cell, body: Html) -> Html:
    return _h(
        '<section id="{i}" aria-labelledby="{i}-h"><h2 id="{i}-h">{t}</h2>{b}</section>',
        i=ident,
        t=title,
        b=body,
    )


def _facts(facts: Iterable[tuple[str, Cell]]) -> Html:
    items = _join(_h("<div><dt>{k}</dt><dd>{v}</dd></div>", k=k, v=v) for k, v in facts)
    return _h('<dl class="facts">{items}</dl>', items=items)


def _badge(phase: str) -> Html:
    kind = _KIND.get(phase, "off")
    return _h(
        '<span class="badge {kind}"><span aria-hidden="true">{mark}</span> {phase}</span>',
        kind=kind,
        mark=_MARK[kind],
        phase=phase,
    )


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return "just now"


def _when(stamp: str | None, now: float) -> Html:
    if stamp is None:
        return DASH
    return _h(
        '<time datetime="{stamp}">{clock} <span class="ago">({ago})</span></time>',
        stamp=stamp,
        clock=stamp[:19].replace("T", " ") + " UTC",
        ago=_ago(now - _epoch(stamp)),
    )


def _sync_time(sync: Sync) -> str:
    """When a sync row last ran: its latest repeat, else its end, else its start. The one
    definition the header, the environments and the history all show."""
    return sync.last_seen or sync.finished or sync.started


def _sha(revision: str | None) -> Html:
    if not revision:
        return DASH
    return _h('<code title="{rev}">{short}</code>', rev=revision, short=revision[:7])


def _tag(tag: str | None) -> Html:
    """A build tag by its hash, the whole tag on hover (the runtime has a column)."""
    return _h('<code title="{t}">{s}</code>', t=tag, s=tag.rpartition("-")[2][:12]) if tag else DASH


def _code(text: str | None) -> Html:
    return _h("<code>{t}</code>", t=text) if text else DASH


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _error_lines(text: str, limit: int = 8) -> list[str]:
    found = dict.fromkeys(line.strip() for line in text.splitlines() if _ERROR_LINE.search(line))
    return [_clip(line) for line in found][:limit]


def _log_line(line: str) -> Html:
    return _h('<mark class="err">{t}</mark>' if _ERROR_LINE.search(line) else "{t}", t=line)


def _brief(message: str | None) -> Html:
    """A message's first line and the error lines after it: what a table row has room for."""
    first, _, rest = (message or "").strip().partition("\n")
    lines = [_h('<span class="line">{t}</span>', t=_clip(first))] if first else []
    lines += [_h('<span class="line err">{t}</span>', t=t) for t in _error_lines(rest, 2)]
    return _join(lines)


def _url_link(url: str | None) -> Html:
    """The function's URL as text, linked by path so it works wherever the page is seen from."""
    if not url or not url.startswith(("http://", "https://")):
        return DASH
    return _h('<a class="url" href="{path}">{url}</a>', path=urlsplit(url).path or "/", url=url)


def _env_order(env: str, tracked: str) -> tuple[int, int, str]:
    preview = re.fullmatch(r"pr-(\d+)", env)
    if env == tracked:
        return (0, 0, env)
    return (1, int(preview.group(1)), env) if preview else (2, 0, env)


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def _status_kind(status: int) -> str:
    return "bad" if status >= 500 else "warn" if status >= 400 else "ok"


# --- commits, from the mirror -----------------------------------------------------------


@dataclass(frozen=True)
class Commit:
    subject: str
    author: str
    time: float


class Commits:
    """Subject, author and time of a revision, read (never written) from the mirror.

    A commit never changes, so one found is kept; a miss is not (it may be fetched later).
    """

    def __init__(self, path: Callable[[], Path | None]) -> None:
        self._path = path
        self._found: dict[str, Commit] = {}

    def get(self, revision: str | None) -> Commit | None:
        if revision and revision not in self._found:
            commit = self._read(revision)
            if commit is None:
                return None
            if len(self._found) >= 512:
                self._found.clear()
            self._found[revision] = commit
        return self._found.get(revision or "")

    def _read(self, revision: str) -> Commit | None:
        path = self._path()
        try:
            repo = pygit2.Repository(str(path), RepositoryOpenFlag.NO_SEARCH) if path else None
            found = repo.get(revision) if repo is not None else None
            commit = found.peel(pygit2.Commit) if found is not None else None
        except (pygit2.GitError, KeyError, ValueError, TypeError):
            return None
        if commit is None:
            return None
        message = commit.raw_message.decode("utf-8", "replace").strip()
        author = commit.author.raw_name.decode("utf-8", "replace")
        return Commit(message.splitlines()[0] if message else "", author, commit.commit_time)


# --- the page shell ---------------------------------------------------------------------


def _asset(name: str) -> tuple[bytes, str]:
    data = (resources.files("gitops_sless.web") / "static" / name).read_bytes()
    return data, f"{ASSETS}/{name}?v={hashlib.sha256(data).hexdigest()[:12]}"


_CSS, _CSS_URL = _asset("dashboard.css")
_JS, _JS_URL = _asset("dashboard.js")
_SIGNIN_JS, _SIGNIN_JS_URL = _asset("signin.js")

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>{title}</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{css}">
<script src="{js}" defer></script>
</head>
<body data-refresh-ms="{refresh}">
<a class="skip" href="#main">Skip to content</a>
{header}
<main id="main" data-live tabindex="-1">
{main}
</main>
<footer><a href="/api/v1/status" data-api>Status API</a> · <a href="/docs">API docs</a> · \
<a href="/metrics">Metrics</a></footer>
<p id="live-status" class="live-status" role="status" aria-live="polite"></p>
</body>
</html>
"""


def _page(title: str, header: Html, main: Html, status: int = 200) -> HTMLResponse:
    body = _h(
        _PAGE, title=title, css=_CSS_URL, js=_JS_URL, refresh=REFRESH_MS, header=header, main=main
    )
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


def _asset_response(data: bytes, media_type: str) -> Response:
    headers = {**_HEADERS, "Cache-Control": "public, max-age=86400, immutable"}
    return Response(data, media_type=media_type, headers=headers)


# --- the pages --------------------------------------------------------------------------


class Pages:
    """What each page shows, read at request time from the store, the routes and the mirror."""

    def __init__(
        self,
        reconciler: Any,
        store: Store,
        repository: str,
        branch: str,
        poll: float | None,
        forge: str | None = None,
    ) -> None:
        self.reconciler = reconciler
        self.forge = forge
        self.store = store
        self.repository = repository
        self.branch = branch
        self.poll_interval = poll
        self.commits = Commits(self._mirror_path)

    def _mirror_path(self) -> Path | None:
        path = getattr(getattr(self.reconciler, "source", None), "path", None)
        return Path(path) if path else None

    def _status(self) -> Status:
        env = self.reconciler.env
        return Status.from_rows(
            repository=self.repository,
            branch=self.branch,
            environment=env,
            functions=self.store.functions(env),
            syncs=self.store.syncs(MAX_SYNCS, env),
        )

    # the header, on every page ----------------------------------------------------------

    def header(self, status: Status, now: float, signout: Html = NO_HTML) -> Html:
        facts: list[tuple[str, Cell]] = [
            ("Repository", _code(status.repository)),
            ("Branch", _code(status.branch)),
            ("Revision", self._revision(status, now)),
            ("Last sync", self._last_sync(status.last_sync, now)),
        ]
        if self.poll_interval:
            facts.append(("Next poll", self._next_poll(status.last_sync, now)))
        sync = status.last_sync
        error = _h('<pre class="sync-error">{e}</pre>', e=sync.error) if sync and sync.error else ""
        return _h(
            '<header id="top" class="top" data-live><p class="brand"><a href="/">gitops-sless'
            "</a></p>{signout}{facts}{error}</header>",
            signout=signout,
            facts=_facts(facts),
            error=Html(error),
        )

    def _revision(self, status: Status, now: float) -> Html:
        revision = status.fetched_revision
        if not revision:
            return Html("nothing fetched yet")
        parts = [_sha(revision)]
        commit = self.commits.get(revision)
        if commit:
            parts.append(_h(' <span class="subject">{s}</span>', s=commit.subject))
            ago = _ago(now - commit.time)
            parts.append(_h(' <span class="muted">{a}, {ago}</span>', a=commit.author, ago=ago))
        good = status.last_good_revision
        if good and good != revision:
            parts.append(_h(' <span class="muted">(last good {g})</span>', g=_sha(good)))
        return _join(parts)

    def _last_sync(self, sync: Sync | None, now: float) -> Html:
        if sync is None:
            return Html("no sync yet")
        return _h(
            "{badge} {trigger}, {when}",
            badge=_badge(sync.result),
            trigger=sync.trigger,
            when=_when(_sync_time(sync), now),
        )

    def _next_poll(self, sync: Sync | None, now: float) -> str:
        """An estimate: polls come every interval, and the latest pass is usually one."""
        interval = self.poll_interval or 0
        if sync is not None and sync.result == "Running":
            return "a sync is running"
        last = _sync_time(sync) if sync else None
        due = _epoch(last) + interval - now if last else interval
        return f"in about {math.ceil(due)} s (every {interval:g} s)" if due >= 1 else "due now"

    # the index ----------------------------------------------------------------------------

    def index(self, signout: Html = NO_HTML, syncs_of: str | None = None) -> HTMLResponse:
        """``syncs_of``: the environment whose passes the sync history shows (None: all)."""
        now = time.time()
        status = self._status()
        envs = sorted(self.store.environments(), key=lambda e: _env_order(e, status.environment))
        sections = [self._environment(env, now) for env in envs] or [
            Html('<p class="empty">No functions yet: the first sync has not finished.</p>')
        ]
        phases = ", ".join(f"{n} {p}" for p, n in sorted(status.phases.items()))
        title = f"gitops-sless: {phases}" if phases else "gitops-sless"
        main = _join([*sections, self._syncs(now, envs, syncs_of)], "\n")
        return _page(title, self.header(status, now, signout), main)

    def _environment(self, env: str, now: float) -> Html:
        rows = self.store.functions(env)
        info = Environment.from_rows(env, rows, self.store.last_sync(env))
        sync = info.last_sync
        summary = _h(
            '<p class="muted">{n} functions · last sync {badge} {when}</p>',
            n=info.functions,
            badge=_badge(sync.result) if sync else "",
            when=_when(_sync_time(sync), now) if sync else "never",
        )
        summary = Html(self._preview(env, rows, now) + summary)
        if not rows:
            return _section(f"env-{env}", env, Html(summary + "<p>No functions declared.</p>"))
        table = _table((*_FUNCTION_COLUMNS, "Message"), (self._row(env, row) for row in rows))
        return _section(f"env-{env}", env, Html(summary + table))

    def _preview(self, env: str, rows: list[dict[str, Any]], now: float) -> Html:
        """A preview's state and why, and the pull request it previews."""
        number = re.fullmatch(r"pr-([1-9][0-9]{0,9})", env)
        row = self.store.preview(int(number.group(1))) if number else None
        if row is None:
            return NO_HTML
        link = pull_request_link(self.repository, row["number"], self.forge)
        pr = Preview.from_row(row, rows, link)
        state = _h("{badge}", badge=_badge(pr.state))
        if pr.reason:
            state = _h('{s} <span class="reason">{r}</span>', s=state, r=pr.reason)
        name = _h("#{n}", n=pr.number)
        if pr.title:
            name = _h("{n} {t}", n=name, t=pr.title)
        if pr.link:
            name = _h('<a class="pr-link" href="{href}">{n}</a>', href=pr.link, n=name)
        branches = _h(
            "<code>{head}</code> → <code>{base}</code>",
            head=pr.head_branch or "?",
            base=pr.base or "?",
        )
        facts: list[tuple[str, Cell]] = [
            ("Preview", state),
            ("Pull request", name),
            ("Author", pr.author or DASH),
            ("Branches", branches if pr.head_branch or pr.base else DASH),
            ("Head", _sha(pr.head)),
            ("Updated", _when(pr.updated, now)),
        ]
        return _h('<div class="preview" id="preview-{e}">{f}</div>', e=env, f=_facts(facts))

    def _row(self, env: str, row: dict[str, Any]) -> Html:
        fn = FunctionDetail.from_rows(row, None, [], [])
        page = f"/functions/{quote(env, safe='')}/{quote(fn.name, safe='')}"
        cells = [
            _h('<a href="{page}">{name}</a>', page=page, name=fn.name),
            _badge(fn.phase),
            self._runtime(fn.build_tag) or DASH,
            _tag(fn.build_tag),
            _sha(fn.revision),
            self._replicas(env, row),
            _url_link(fn.url),
            _brief(fn.message),
        ]
        attrs = _h(' id="fn-{e}-{n}" data-phase="{p}"', e=env, n=fn.name, p=fn.phase)
        return _tr((*_FUNCTION_COLUMNS, "Message"), cells, attrs)

    def _runtime(self, tag: str | None) -> str | None:
        build = self.store.build(tag) if tag else None
        return build["runtime"] if build else (tag.rpartition("-")[0] if tag else None)

    def _replicas(self, env: str, row: dict[str, Any]) -> str:
        """Serving/wanted: replicas in the route out of those the manifest asks for."""
        spec = row.get("spec") or {}
        if not spec:
            return "—"
        if not spec.get("http") or row["phase"] == "Disabled":
            return "0"
        routes = getattr(self.reconciler, "routes", None)
        if routes is None:
            return str(spec.get("replicas", 1))
        route = routes.get(env, row["name"])
        return f"{route.serving if route else 0}/{spec.get('replicas', 1)}"

    def _syncs(self, now: float, envs: Sequence[str], only: str | None) -> Html:
        only = only if only in envs else None
        syncs = [Sync.from_row(row) for row in self.store.syncs(RECENT_SYNCS, only)]
        rows = (
            _tr(
                _SYNC_COLUMNS,
                [
                    f"#{s.id}",
                    s.env,
                    _when(s.started, now),
                    s.trigger,
                    _sha(s.revision),
                    _badge(s.result),
                    _h("{n}, latest {w}", n=s.count, w=_when(s.last_seen, now))
                    if s.last_seen
                    else "1",
                    _brief(s.error),
                ],
            )
            for s in syncs
        )
        note = (
            '<p class="muted">Passes that changed nothing are counted in the row they repeat.</p>'
        )
        body = _sync_filter(envs, only) + note + _table(_SYNC_COLUMNS, rows)
        return _section("syncs", "Sync history", Html(body))

    # one function ---------------------------------------------------------------------------

    def function(self, env: str, name: str, signout: Html = NO_HTML) -> HTMLResponse:
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
        main = _join(
            [
                self._summary(env, fn, row, now),
                self._build(fn, now, self._built_with(env, row)),
                self._jobs([job for job in fn.jobs if job.function == name], now),
                self._calls(fn.invocations, now),
            ],
            "\n",
        )
        return _page(f"{name}: {fn.phase} · gitops-sless", header, main)

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
            ("URL", _url_link(fn.url)),
            ("Manifest", _code(fn.manifest)),
            ("Updated", _when(fn.updated, now)),
            ("Restarts", str(fn.restarts)),
            ("Last exit", fn.last_exit or DASH),
        ]
        failed = fn.build is not None and fn.build.phase == "Failed"
        message = (fn.message or "").strip()
        if failed:
            message = message.partition("\n")[0]  # the log is below, its errors just under
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

    def _calls(self, calls: list[Invocation], now: float) -> Html:
        if not calls:
            return _section("calls", "Recent calls", Html('<p class="muted">No calls yet.</p>'))
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
                ],
            )
            for call in calls[:RECENT_CALLS]
        )
        return _section("calls", "Recent calls", Html(_chart(calls) + _table(_CALL_COLUMNS, rows)))


def _sync_filter(envs: Sequence[str], only: str | None) -> Html:
    """Links that show one environment's passes, or all: plain links, so they work
    without the script, and the page's refresh keeps the choice (it fetches its own URL)."""

    def link(label: str, href: str, chosen: bool) -> Html:
        current = Html(' aria-current="true"') if chosen else NO_HTML
        return _h('<a href="{href}"{c}>{label}</a>', href=href, c=current, label=label)

    links = [link("all", "/#syncs", only is None)]
    links += [link(env, f"/?syncs={quote(env, safe='')}#syncs", env == only) for env in envs]
    return _h(
        '<nav class="sync-filter" aria-label="Show the passes of">Show: {links}</nav>',
        links=_join(links, " · "),
    )


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


# --- signing in -----------------------------------------------------------------------

_SIGNIN_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>Sign in · gitops-sless</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="{css}">
<script src="{js}" defer></script>
</head>
<body class="signin">
<main id="main" tabindex="-1">
<h1>gitops-sless</h1>
<form class="signin" method="post" action="/signin">
<p>This server shows its functions, builds, job results and logs to people with a token.</p>
{notice}
<label for="token">Token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required \
autofocus>
<input type="hidden" name="next" value="{next}">
<button type="submit">Sign in</button>
<p class="muted">The read token (<code>SLESS_READ_TOKEN</code>) or the API token \
(<code>SLESS_API_TOKEN</code>) the server was started with. The browser keeps a session \
for 12 hours, never the token.</p>
</form>
</main>
</body>
</html>
"""
_SIGNOUT = (
    '<form class="signout" method="post" action="/signout" data-csrf="{csrf}" '
    'data-csrf-header="{header}"><button type="submit">Sign out</button></form>'
)


_CROSS_SITE = "Refused: the form was sent by another site."


def _next_path(value: str | None) -> str:
    """A path on this server to go back to; anything else (another site) is ``/``."""
    if (
        not value
        or len(value) > 2000
        or not value.startswith("/")
        or value.startswith(("//", "/\\"))
        or any(ord(c) < 0x20 or c == "\\" for c in value)
        or value.startswith(("/signin", "/signout"))
    ):
        return "/"
    return value


def _signin_response(next_path: str, notice: Html, status: int) -> HTMLResponse:
    body = _h(
        _SIGNIN_PAGE, css=_CSS_URL, js=_SIGNIN_JS_URL, notice=notice, next=_next_path(next_path)
    )
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


def signin_page(request: Request) -> HTMLResponse:
    """What a signed-out browser is shown at a page that needs a token: the form, 401."""
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return _signin_response(path, Html(""), 401)


def _notice(text: str, kind: str = "error") -> Html:
    role = "alert" if kind == "error" else "status"
    return _h('<p class="{k}" role="{r}" id="signin-{k}">{t}</p>', k=kind, r=role, t=text)


async def _form(request: Request) -> dict[str, str] | None:
    """The fields of a urlencoded form of at most MAX_FORM_BYTES; None past that."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return None
    except ClientDisconnect:
        return None
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    return {key: values[0] for key, values in fields.items()}


def _signin_routes(routes: APIRouter, access: Access) -> None:
    """``/signin`` (the form, and the post that exchanges a token for a session), ``/signout``."""

    @routes.get("/signin")
    def signin_form(request: Request) -> Response:
        if access.open_reads:
            return RedirectResponse("/", status_code=303)
        out = "signed-out" in request.query_params
        notice = _notice("You are signed out.", "notice") if out else Html("")
        return _signin_response(request.query_params.get("next", "/"), notice, 200)

    @routes.post("/signin")
    async def signin(request: Request) -> Response:
        if not access.same_origin(request):
            return _signin_response("/", _notice(_CROSS_SITE), 403)
        form = await _form(request)
        if form is None:
            return _signin_response("/", _notice("Refused: the form is too large."), 413)
        next_path = _next_path(form.get("next"))
        if access.open_reads:
            return RedirectResponse(next_path, status_code=303)
        if access.token_level(form.get("token", "")) < Level.READ:
            return _signin_response(next_path, _notice("That token is not valid."), 401)
        response = RedirectResponse(next_path, status_code=303)
        access.set_session(response, request)
        return response

    @routes.post("/signout")
    def signout(request: Request) -> Response:
        if not access.same_origin(request):
            return _signin_response("/", _notice(_CROSS_SITE), 403)
        response = RedirectResponse("/signin?signed-out", status_code=303)
        access.clear_session(response, request)
        return response


def router(
    reconciler: Any,
    store: Store,
    repository: str,
    branch: str,
    poll_interval: float | None = None,
    access: Access | None = None,
    forge: str | None = None,
) -> APIRouter:
    """The dashboard's routes: ``/``, ``/functions/{env}/{name}``, its two assets, sign-in.

    ``poll_interval`` (seconds) lets the header say when the next poll is due. ``access``
    (default: open reads, nothing to sign in to) decides who may see the pages. ``forge``
    (else guessed from the repository's URL) links a preview to its pull request.
    """
    access = access or Access(None)
    pages = Pages(reconciler, store, repository, branch, poll_interval, forge)
    routes = APIRouter(include_in_schema=False)

    def signout(request: Request) -> Html:
        """The sign-out button, for a browser signed in with a session; it carries the
        session's CSRF token, for the script's calls to /api/."""
        cookie = request.cookies.get(COOKIE)
        session = not access.open_reads and access.session_valid(cookie)
        csrf = access.csrf_token(cookie) if session else None
        return _h(_SIGNOUT, csrf=csrf, header=CSRF_HEADER) if csrf else Html("")

    @routes.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        return pages.index(signout(request), request.query_params.get("syncs"))

    @routes.get("/functions/{env}/{name}", response_class=HTMLResponse)
    def function(env: str, name: str, request: Request) -> HTMLResponse:
        return pages.function(env, name, signout(request))

    @routes.get(f"{ASSETS}/dashboard.css")
    def css() -> Response:
        return _asset_response(_CSS, "text/css; charset=utf-8")

    @routes.get(f"{ASSETS}/dashboard.js")
    def js() -> Response:
        return _asset_response(_JS, "text/javascript; charset=utf-8")

    @routes.get(f"{ASSETS}/signin.js")
    def signin_js() -> Response:
        return _asset_response(_SIGNIN_JS, "text/javascript; charset=utf-8")

    _signin_routes(routes, access)
    return routes
