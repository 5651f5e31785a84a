"""The overview page at ``/``: every environment's functions, previews and recent passes."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from fastapi.responses import HTMLResponse

from ...previews.prlinks import pull_request_link
from ..models import Environment, FunctionDetail, Preview, Sync
from .html import (
    _FUNCTION_COLUMNS,
    _SYNC_COLUMNS,
    DASH,
    NO_HTML,
    RECENT_SYNCS,
    Cell,
    Html,
    _badge,
    _brief,
    _env_order,
    _facts,
    _h,
    _join,
    _page,
    _section,
    _sha,
    _sync_time,
    _table,
    _tag,
    _tr,
    _url_link,
    _when,
)
from .queue import dead_badge
from .site import Site


class Overview(Site):
    """The page at ``/``."""

    def index(
        self, signout: Html = NO_HTML, syncs_of: str | None = None, unready: bool = False
    ) -> HTMLResponse:
        """``syncs_of``: the environment whose passes the sync history shows (None: all);
        ``unready``: list only the functions that are not Ready (nor Idle, Ready at zero)."""
        now = time.time()
        status = self._status()
        envs = sorted(self.store.environments(), key=lambda e: _env_order(e, status.environment))
        sections = [self._environment(env, now, unready) for env in envs] or [
            Html('<p class="empty">No functions yet: the first sync has not finished.</p>')
        ]
        if envs:
            waiting = sum(n for p, n in status.phases.items() if p not in READY_PHASES)
            sections.insert(0, _phase_filter(unready, waiting, syncs_of))
        phases = ", ".join(f"{n} {p}" for p, n in sorted(status.phases.items()))
        title = f"gitops-sless: {phases}" if phases else "gitops-sless"
        main = _join([*sections, self._syncs(now, envs, syncs_of, unready)], "\n")
        return _page(title, self.header(status, now, signout), main)

    def _environment(self, env: str, now: float, unready: bool = False) -> Html:
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
        shown = [row for row in rows if row["phase"] not in READY_PHASES] if unready else rows
        if not shown:
            note = _h('<p class="muted">All {n} are Ready.</p>', n=len(rows))
            return _section(f"env-{env}", env, Html(summary + note))
        table = _table(
            (*_FUNCTION_COLUMNS, "Message"), (self._row(env, row) for row in shown), "list"
        )
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
            _h(
                '<a href="{page}">{name}</a>{dead}',
                page=page,
                name=fn.name,
                dead=dead_badge(self.queue.counts(env, fn.name)),
            ),
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
        scaled = self.scaling(env, row["name"]) if self.scaling and route else None
        if scaled:  # autoscaled: ready out of what the autoscaler wants now
            desired = scaled["desired"] if scaled["desired"] is not None else DASH
            return f"{scaled['ready']}/{desired} (max {scaled['max']})"
        return f"{route.serving if route else 0}/{spec.get('replicas', 1)}"

    def _syncs(
        self, now: float, envs: Sequence[str], only: str | None, unready: bool = False
    ) -> Html:
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
        body = _sync_filter(envs, only, unready) + note + _table(_SYNC_COLUMNS, rows)
        return _section("syncs", "Sync history", Html(body))

    # one function ---------------------------------------------------------------------------


READY_PHASES = ("Ready", "Idle")  # Idle: Ready at zero replicas, woken by its next call


def _phase_filter(unready: bool, waiting: int, syncs_of: str | None) -> Html:
    """All functions, or those that are not Ready: plain links (no script needed), which
    keep the sync history's choice, as its links keep this one."""
    keep = f"&syncs={quote(syncs_of, safe='')}" if syncs_of else ""
    current = Html(' aria-current="true"')
    return _h(
        '<nav class="phase-filter" aria-label="Show the functions">Show: '
        '<a href="/{all_q}"{a}>all</a> · '
        '<a href="/?functions=unready{keep}"{u}>not Ready ({n})</a></nav>',
        all_q=f"?{keep[1:]}" if keep else "",
        a=current if not unready else NO_HTML,
        keep=keep,
        u=current if unready else NO_HTML,
        n=waiting,
    )


def _sync_filter(envs: Sequence[str], only: str | None, unready: bool = False) -> Html:
    """Links that show one environment's passes, or all: plain links, so they work
    without the script, and the page's refresh keeps the choice (it fetches its own URL).
    They keep the function filter's choice."""

    def link(label: str, env: str | None) -> Html:
        current = Html(' aria-current="true"') if env == only else NO_HTML
        query = [f"syncs={quote(env, safe='')}"] if env else []
        query += ["functions=unready"] if unready else []
        href = "/" + ("?" + "&".join(query) if query else "") + "#syncs"
        return _h('<a href="{href}"{c}>{label}</a>', href=href, c=current, label=label)

    links = [link("all", None), *(link(env, env) for env in envs)]
    return _h(
        '<nav class="sync-filter" aria-label="Show the passes of">Show: {links}</nav>',
        links=_join(links, " · "),
    )
