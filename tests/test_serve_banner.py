"""The start-up banner: every function with its phase, and why it is not Ready, in full."""

from __future__ import annotations

from . import gitserver
from .test_serve import HTTP, handler, manifest, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

SECRET_ENV = "    env: {PG_DSN: {secret: notes-db, key: dsn}}"


def _banner_entry(output: str, name: str) -> list[str]:
    """The banner's line for ``name`` and the indented lines that continue it."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if f"/fn/prod/{name}/" in line)
    entry = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 12):
            break
        entry.append(line)
    return entry


def test_a_long_reason_is_wrapped_whole_never_cut_inside_its_parentheses(setup):
    setup.push(
        {
            "needs-db/sless.yaml": manifest("needs-db", HTTP, SECRET_ENV),
            "needs-db/handler.py": handler("db"),
        }
    )
    server = setup.serve()
    server.wait(lambda: "gitops-sless is serving" in server.output(), "the banner")

    entry = _banner_entry(server.output(), "needs-db")
    assert entry[0].split()[0] == "Pending"
    reason = " ".join(line.strip() for line in entry[1:])
    assert reason.startswith("secret 'notes-db' key 'dsn': no secrets directory is configured")
    assert reason.endswith("DIR/SECRET/KEY)"), reason  # the whole reason, to its end
    assert reason.count("(") == reason.count(")") and "…" not in reason
    assert all(len(line) <= 100 for line in entry), entry
