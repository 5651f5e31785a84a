"""Each step of a pass runs alone, on a real local backend and store: what it changes
is what a user then sees (the records, what serves, the routes, the history)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gitops_sless.errors import PermanentError
from gitops_sless.local.backend import LocalBackend
from gitops_sless.local.secrets import SecretsDir
from gitops_sless.source.snapshot import DirectorySnapshot
from gitops_sless.state.inflight import InFlight
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store
from gitops_sless.steps import Apply, Build, Context, Decide, Jobs, Load, PassState, Prune

MANIFEST = (
    "functions:\n"
    "  - name: {name}\n"
    "    runtime: python3.11\n"
    "    entrypoint: handler.main\n"
    "    triggers: [{{type: http}}]\n"
)
HANDLER = "def main(event):\n    return {'text': %r}\n"


def write_function(repo: Path, name: str, text: str) -> None:
    (repo / name).mkdir(parents=True, exist_ok=True)
    (repo / name / "sless.yaml").write_text(MANIFEST.format(name=name))
    (repo / name / "handler.py").write_text(HANDLER % text)


class Env:
    """One environment's context on a real local backend (unconfined: the steps, not the
    sandbox, are under test here)."""

    def __init__(self, tmp_path: Path) -> None:
        self.repo = tmp_path / "repo"
        self.repo.mkdir()
        self.routes = RouteTable()
        self.store = Store(tmp_path / "state" / "status.db")
        self.backend = LocalBackend(tmp_path / "state", self.routes, SecretsDir(None))
        self.pool = ThreadPoolExecutor(2)
        self.work = InFlight(4)
        self.ctx = Context("prod", self.backend, self.store, self.work, self.pool)

    def snapshot(self) -> DirectorySnapshot:
        return DirectorySnapshot(self.repo)

    def close(self) -> None:
        self.work.shutdown()
        self.pool.shutdown()
        self.backend.close()
        self.store.close()

    def call(self, name: str) -> str:
        upstream = self.routes.get("prod", name)
        assert upstream is not None and upstream.upstreams, f"{name} has no replica"
        host, port = upstream.upstreams[0]
        proof = upstream.proof.decode().strip().split(": ", 1)
        return httpx.get(f"http://{host}:{port}/", headers=[proof], timeout=10).json()["text"]


@pytest.fixture
def env(tmp_path: Path):
    e = Env(tmp_path)
    yield e
    e.close()


def test_load_caches_a_revision_and_logs_each_problem_once(env, caplog):
    write_function(env.repo, "good", "hi")
    (env.repo / "bad").mkdir()
    (env.repo / "bad" / "sless.yaml").write_text("functions: [{name: Bad_Name}]\n")
    load = Load(env.ctx)
    first = load.run(env.snapshot())
    assert set(first.functions) == {"good"} and first.problems
    assert load.run(env.snapshot()) is first  # same revision: the same state, not parsed again
    assert env.ctx.desired is first
    load.log_problems(first)
    load.log_problems(first)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bad/")]
    assert sorted(logged) == sorted(str(p) for p in first.problems)  # each once


def test_build_apply_and_prune_alone_take_a_function_from_code_to_serving_and_away(env):
    write_function(env.repo, "greet", "hello")
    snapshot = env.snapshot()
    desired = Load(env.ctx).run(snapshot)
    decide = Decide(env.ctx, Jobs(env.ctx))
    current = PassState("test", 0.0)

    planned = decide.run(desired)
    assert [fn.name for fn in planned.builds] == ["greet"]
    Build(env.ctx).run(planned.builds[0], snapshot)  # in the foreground: the step alone
    assert env.store.build(planned.builds[0].build_tag, "")["phase"] == "Succeeded"

    planned = decide.run(desired)
    assert [d.name for d in planned.applies] == ["greet"]
    Apply(env.ctx).run(planned, snapshot.revision, current)
    assert current.applies == 1 and current.changed  # the pass got a history row
    assert env.call("greet") == "hello"
    assert {row["name"] for row in env.store.serving("prod")} == {"greet"}

    (env.repo / "greet" / "sless.yaml").unlink()  # the repository no longer declares it
    empty = Load(env.ctx).run(env.snapshot())
    planned = Decide(env.ctx, Jobs(env.ctx), allow_empty=True).run(empty)
    assert planned.prunes == ["greet"]
    Prune(env.ctx).run(planned, current)
    assert current.prunes == 1
    assert env.store.serving("prod") == []
    assert "greet" not in env.backend.deployed("prod")


def test_decide_refuses_to_empty_an_environment_unless_allowed(env):
    write_function(env.repo, "greet", "hello")
    snapshot = env.snapshot()
    desired = Load(env.ctx).run(snapshot)
    decide = Decide(env.ctx, Jobs(env.ctx))
    Build(env.ctx).run(decide.run(desired).builds[0], snapshot)
    Apply(env.ctx).run(decide.run(desired), snapshot.revision, PassState("test", 0.0))

    (env.repo / "greet" / "sless.yaml").unlink()
    empty = Load(env.ctx).run(env.snapshot())
    refused = decide.run(empty)
    assert refused.prunes == [] and "refused to prune all 1 functions of prod" in refused.refused


def test_apply_backs_off_a_deploy_that_keeps_failing(env, monkeypatch):
    write_function(env.repo, "greet", "hello")
    snapshot = env.snapshot()
    desired = Load(env.ctx).run(snapshot)
    decide = Decide(env.ctx, Jobs(env.ctx))
    Build(env.ctx).run(decide.run(desired).builds[0], snapshot)
    planned = decide.run(desired)

    def refuse(deployment, revision):
        raise PermanentError("the port is taken")

    monkeypatch.setattr(env.backend, "apply", refuse)
    now = [1000.0]
    env.ctx.clock = lambda: now[0]
    apply, current = Apply(env.ctx), PassState("test", 0.0)
    waits = []
    for _ in range(3):
        apply.run(planned, snapshot.revision, current)
        outcome = env.ctx.outcomes["greet"]
        waits.append(outcome.retry_at - now[0])
        assert (outcome.phase, outcome.message) == ("Failed", "the port is taken")
    assert current.failures == 3
    assert waits[0] < waits[1] < waits[2]  # CrashLoopBackOff: later and later
    # and the plan holds the function until its retry time
    assert "greet" in decide.run(desired).retry_at
