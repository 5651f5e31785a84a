"""A preview's notifications end to end: ``serve --previews --notify-config`` tells a
real HTTP receiver once when a pull request's preview is ready, with its URL, and once
when it is closed; a provider for ``prod`` only hears of neither."""

from __future__ import annotations

import yaml

from ..webhook_receiver import WebhookReceiver
from .test_previews import (
    CHANGED,
    Setup,
    change,
    git_daemon,
    git_root,
    in_state,
    repository,
    setup,
    until,
)

__all__ = ["Setup", "git_daemon", "git_root", "setup"]  # the fixtures

KEY = b"a-preview-notification-key"


def test_a_preview_is_said_ready_with_its_url_then_closed_once(setup):
    receiver = WebhookReceiver()
    try:
        secrets = setup.tmp_path / "secrets"
        (secrets / "notify").mkdir(parents=True)
        (secrets / "notify" / "hmac").write_bytes(KEY)
        providers = []
        for name, envs in (("previews", ["pr-*"]), ("prod", ["prod"])):
            (secrets / "notify" / name).write_text(f"{receiver.url}/{name}")
            providers.append(
                {
                    "name": name,
                    "kind": "webhook",
                    "urlSecret": f"notify/{name}",
                    "hmacSecret": "notify/hmac",
                    "events": ["previewReady", "previewClosed"],
                    "environments": envs,
                }
            )
        config = setup.tmp_path / "notify.yaml"
        config.write_text(yaml.safe_dump({"providers": providers}))
        setup.push_main(repository("main", count=2))
        server = setup.serve(args=["--notify-config", str(config)], secrets_dir=secrets)
        head = setup.open(server, 6, change("preview me"))
        until(in_state(server, 6, "Ready", head), "pr-6 Ready", server)

        def said(kind: str) -> list[dict]:
            server.sync()  # a pass of main wakes the notifications
            return [e for e in receiver.events("/previews") if e["event"] == kind]

        (ready,) = until(lambda: said("previewReady"), "pr-6 said ready", server)
        assert ready["environment"] == "pr-6" and ready["commit"] == head
        assert ready["url"] == f"{server.base}/fn/pr-6/"
        assert f"{server.base}/fn/pr-6/{CHANGED}/".startswith(ready["url"])

        auth = {"Authorization": f"Bearer {server.token}"}
        assert server.client.delete("/api/v1/environments/pr-6", headers=auth).status_code == 202
        (closed,) = until(lambda: said("previewClosed"), "pr-6 said closed", server)
        assert closed["environment"] == "pr-6"
        server.sync()
        until(lambda: said("previewClosed"), "another look", server)
        assert len(said("previewReady")) == 1 and len(said("previewClosed")) == 1
        assert all(d.signed_by(KEY) for d in receiver.accepted("/previews"))
        shown = server.client.get("/api/v1/notifications").json()["providers"]
        assert {p["name"]: p["events"] for p in shown} == {"previews": 2, "prod": 0}
        assert not receiver.accepted("/prod")
    finally:
        receiver.close()
