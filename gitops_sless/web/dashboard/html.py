"""The dashboard's markup: escaped-by-default HTML, formatting, the page shell, assets
and the commits read from the mirror."""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import pygit2
from fastapi.responses import HTMLResponse, Response
from pygit2.enums import RepositoryOpenFlag

from ..models import Sync

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
    r"|not found|denied|timed out|killed)\b|npm err!|\w(?:Error|Exception)\b"
)
_KIND = {
    "Ready": "ok",
    "Idle": "ok",
    "Succeeded": "ok",
    "Failed": "bad",
    "RolledBack": "bad",
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
_CALL_COLUMNS = ("Time", "Method", "Path", "Status", "Latency", "Start", "Request")


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


def _table(columns: Sequence[str], rows: Iterable[Html], kind: str = "cards") -> Html:
    """``kind``: how it folds below 760 px, "cards" (each row a card of labelled cells)
    or "list" (a line per row: its heading cell, badge and message; the rest is a click
    away, on the row's own page)."""
    head = _join(_h('<th scope="col">{c}</th>', c=c) for c in columns)
    return _h(
        '<table class="{kind}"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>',
        kind=kind,
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
    # a line may break after a '/', never inside a name: http://host/fn/prod/<wbr>greeting-py/
    parts = url.split("/")
    text = _join([*(_h("{p}/<wbr>", p=p) for p in parts[:-1]), _h("{p}", p=parts[-1])])
    return _h('<a class="url" href="{path}">{text}</a>', path=urlsplit(url).path or "/", text=text)


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
