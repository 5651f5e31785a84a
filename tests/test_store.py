"""The status store: survives restarts, bounds what grows, refuses unknown phases."""

from __future__ import annotations

import pytest

from gitops_sless import store as store_mod
from gitops_sless.store import Store


def test_records_survive_a_restart(tmp_path):
    db = tmp_path / "status.db"
    first = Store(db)
    sync = first.begin_sync("prod", "startup")
    first.finish_sync(sync, "Succeeded", "abc123")
    first.set_function("prod", "greet", phase="Ready", build_tag="python3.11-x", spec={"a": 1})
    first.start_build("python3.11-x", "python3.11", "tree")
    first.finish_build("python3.11-x", "Succeeded", "log text")
    first.set_job_run("prod", "clock", 1, function="clocker", phase="Succeeded", result='"12"')
    first.close()

    again = Store(db)
    assert again.last_sync("prod")["revision"] == "abc123"
    assert again.function("prod", "greet")["spec"] == {"a": 1}
    assert again.build("python3.11-x")["phase"] == "Succeeded"
    assert again.latest_success("prod", "clock")["result"] == '"12"'
    assert again.environments() == ["prod"]
    assert again.path.with_name("status.db-wal").exists()  # WAL mode


def test_updates_keep_fields_not_given(tmp_path):
    store = Store(tmp_path / "s.db")
    store.set_function("prod", "f", phase="Ready", url="http://x/fn/prod/f/", message=None)
    store.set_function("prod", "f", phase="Failed", message="build failed")
    record = store.function("prod", "f")
    assert (record["phase"], record["url"], record["message"]) == (
        "Failed",
        "http://x/fn/prod/f/",
        "build failed",
    )


def test_unknown_phases_and_fields_are_refused(tmp_path):
    store = Store(tmp_path / "s.db")
    with pytest.raises(ValueError, match="unknown phase 'Running'"):
        store.set_function("prod", "f", phase="Running")
    with pytest.raises(ValueError, match="unknown function fields"):
        store.set_function("prod", "f", colour="red")
    with pytest.raises(ValueError, match="unknown job phase"):
        store.set_job_run("prod", "j", 1, phase="Ready")


def test_invocations_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "MAX_INVOCATIONS", 10)
    store = Store(tmp_path / "s.db")
    for batch in range(3):
        store.record_invocations(
            ("prod", "f", "GET", f"/{batch}-{i}", 200, 1.0, 0.0, "r") for i in range(8)
        )
    rows = store.invocations("prod", "f", limit=100)
    assert 8 <= len(rows) <= 11
    assert rows[0]["path"] == "/2-7"  # newest first


def test_jobs_runs_are_per_environment(tmp_path):
    store = Store(tmp_path / "s.db")
    store.set_job_run("prod", "j", 1, function="f", phase="Succeeded", result="1")
    store.set_job_run("pr-3", "j", 1, function="f", phase="Failed", error="boom")
    assert store.job_run("prod", "j", 1)["phase"] == "Succeeded"
    assert store.job_run("pr-3", "j", 1)["error"] == "boom"
    assert store.latest_success("pr-3", "j") is None
