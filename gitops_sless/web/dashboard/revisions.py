"""A function's revisions on its page: which serves, a rollout under way or how the last
one ended, a pin, and (signed in with the API token) a button to roll back to each kept
revision and one to unpin.

The buttons are plain forms posted to ``/functions/{env}/{name}/rollback`` and
``.../unpin`` (no script: the page's Content-Security-Policy allows forms to this
origin only), each carrying the session's CSRF token; ``access.form_refusal`` checks
it, the origin and that the session was signed in with the API token.
"""

from __future__ import annotations

from ..revisions import RevisionList, RevisionView
from .html import DASH, NO_HTML, Html, _h, _join, _section, _sha, _table, _tr, _url_link

__all__ = ["section"]

_COLUMNS = ("Revision", "Traffic", "State", "Replicas", "Commit", "URL", "Switch")
_FORM = (
    '<form class="switch" method="post" action="/functions/{env}/{name}/{action}">'
    '<input type="hidden" name="csrf" value="{csrf}">{to}'
    '<button type="submit">{label}</button></form>'
)


def _form(env: str, name: str, action: str, csrf: str, label: str, to: str | None) -> Html:
    hidden = _h('<input type="hidden" name="to" value="{to}">', to=to) if to else NO_HTML
    return _h(_FORM, env=env, name=name, action=action, csrf=csrf, to=hidden, label=label)


def section(listing: RevisionList | None, csrf: str | None, writable: bool) -> Html:
    """``csrf``: the session's token when it may change things (else no buttons);
    ``writable``: the environment is the tracked branch's (a preview is never rolled
    back)."""
    if listing is None:
        return NO_HTML
    env, name = listing.env, listing.function
    buttons = csrf if writable else None
    parts: list[Html] = []
    pin = listing.pinned
    if pin is not None:
        unpin = _form(env, name, "unpin", buttons, "Unpin", None) if buttons else NO_HTML
        parts.append(
            _h(
                '<p class="pinned"><strong>Pinned at {rev}</strong> by {by}: it differs from '
                "git on purpose, until a commit changes it or it is unpinned. {unpin}</p>",
                rev=pin.revision,
                by=pin.by,
                unpin=unpin,
            )
        )
    rollout = listing.rollout
    if rollout is not None and rollout.phase != "Promoted" and rollout.message:
        parts.append(
            _h(
                '<p class="rollout">Rollout of {c}: <strong>{p}</strong>, {m}</p>',
                c=rollout.candidate or DASH,
                p=rollout.phase,
                m=rollout.message,
            )
        )
    rows = [_row(listing, r, buttons) for r in listing.revisions]
    parts.append(_table(_COLUMNS, rows))
    return _section("revisions", "Revisions", _join(parts, "\n"))


def _row(listing: RevisionList, r: RevisionView, csrf: str | None) -> Html:
    action: Html = NO_HTML
    if csrf and r.state == "kept":
        label = f"Roll back to {r.revision}"
        action = _form(listing.env, listing.function, "rollback", csrf, label, r.revision)
    revision = _h("<strong>{r}</strong>", r=r.revision) if r.state == "serving" else r.revision
    return _tr(
        _COLUMNS,
        [
            revision,
            f"{r.traffic}%",
            r.state,
            str(r.replicas),
            _sha(r.commit),
            _url_link(r.url),
            action,
        ],
    )
