"""The status store: survives restarts, bounds what grows, refuses unknown phases."""

from __future__ import annotations

import pytest

from gitops_sless.state import store as store_mod
from gitops_sless.state.store import Store


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


def test_invocations_are_bounded_per_function(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "MAX_INVOCATIONS_PER_FUNCTION", 10)
    store = Store(tmp_path / "s.db")
    store.record_invocations([("prod", "quiet", "GET", "/kept", 200, 1.0, 0.0, "q")])
    for batch in range(3):
        store.record_invocations(
            ("prod", "f", "GET", f"/{batch}-{i}", 200, 1.0, 0.0, "r") for i in range(8)
        )
    rows = store.invocations("prod", "f", limit=100)
    assert len(rows) == 10
    assert rows[0]["path"] == "/2-7"  # newest first
    # a flood on one function never evicts another's history
    assert [r["path"] for r in store.invocations("prod", "quiet")] == ["/kept"]


def test_long_invocation_paths_are_cut_and_marked(tmp_path):
    store = Store(tmp_path / "s.db")
    store.record_invocations([("prod", "f", "GET", "/" + "é" * 5000, 200, 1.0, 0.0, "r")])
    (row,) = store.invocations("prod", "f")
    assert row["truncated"] == 1
    assert len(row["path"].encode()) <= store_mod.MAX_STORED_PATH
    assert row["path"].startswith("/éé")


def test_a_pass_that_says_the_same_counts_on_the_previous_row(tmp_path):
    store = Store(tmp_path / "s.db")
    first = store.begin_sync("prod", "startup")
    store.finish_sync(first, "Succeeded", "abc")
    for _ in range(5):
        assert store.repeat_sync("prod", "poll", 1.0, "Succeeded", "abc", None) == first
    store.repeat_sync("prod", "poll", 2.0, "Failed", "abc", "remote unreachable")
    store.repeat_sync("prod", "poll", 3.0, "Failed", "abc", "remote unreachable")
    rows = store.syncs(env="prod")
    assert [(r["result"], r["count"]) for r in rows] == [("Failed", 2), ("Succeeded", 6)]
    assert rows[1]["last_seen"] is not None


def test_an_old_database_gains_the_new_columns(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "old.db")
    db.execute(
        "CREATE TABLE syncs (id INTEGER PRIMARY KEY AUTOINCREMENT, env TEXT NOT NULL,"
        " trigger TEXT NOT NULL, started REAL NOT NULL, finished REAL, revision TEXT,"
        " result TEXT NOT NULL, error TEXT)"
    )
    db.execute("INSERT INTO syncs (env, trigger, started, result) VALUES ('prod', 'x', 1, 'Ok')")
    db.commit()
    db.close()
    store = Store(tmp_path / "old.db")
    assert store.last_sync("prod")["count"] == 1


def test_jobs_runs_are_per_environment(tmp_path):
    store = Store(tmp_path / "s.db")
    store.set_job_run("prod", "j", 1, function="f", phase="Succeeded", result="1")
    store.set_job_run("pr-3", "j", 1, function="f", phase="Failed", error="boom")
    assert store.job_run("prod", "j", 1)["phase"] == "Succeeded"
    assert store.job_run("pr-3", "j", 1)["error"] == "boom"
    assert store.latest_success("pr-3", "j") is None


def test_a_pass_writes_every_record_in_one_transaction(tmp_path):
    """Records.update_many, which a pass uses for every function's phase, gives what one
    update per record gives, commits once for all of them (a first pass over 10,000
    functions used to commit 10,000 times), and writes nothing when one record is bad."""
    from gitops_sless.state.records import Records

    fields = {
        f"fn-{i:03d}": {"phase": "Building", "message": f"build {i}", "spec": {"n": i}}
        for i in range(300)
    }
    one_by_one = Records(Store(tmp_path / "a.db"), "prod")
    for name, given in fields.items():
        one_by_one.update(name, **given)
    store = Store(tmp_path / "b.db")
    batched = Records(store, "prod")
    commits: list[str] = []
    store._db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    assert batched.update_many(fields) == 300
    assert len(commits) == 1
    assert batched.update_many(fields) == 0 and len(commits) == 1  # nothing new: no write

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "updated"} for r in rows]

    assert strip(batched.all()) == strip(one_by_one.all())
    assert strip(Records(store, "prod").all()) == strip(one_by_one.all())  # as stored
    assert len(batched.unsettled()) == 300

    bad = {"fn-000": {"phase": "Ready"}, "fn-001": {"phase": "Running"}}
    with pytest.raises(ValueError, match="unknown phase 'Running'"):
        batched.update_many(bad)
    assert store.function("prod", "fn-000")["phase"] == "Building"  # not half written
