"""Garbage collection of the state folder: real builds, real files, nothing in use deleted."""

from __future__ import annotations

from pathlib import Path

from gitops_sless.local import gc
from gitops_sless.local.builder import LocalBuilder
from gitops_sless.manifests import load as manifest
from gitops_sless.source.snapshot import DirectorySnapshot


def _build(builder: LocalBuilder, root: Path, version: int) -> str:
    folder = root / "fn"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sless.yaml").write_text(
        "functions:\n  - name: fn\n    runtime: python3.11\n    entrypoint: handler.main\n"
    )
    (folder / "handler.py").write_text(f"def main(event):\n    return {version}\n")
    snapshot = DirectorySnapshot(root)
    state = manifest.load(snapshot)
    fn = state.functions["fn"]
    builder.build(fn, snapshot)
    return fn.build_tag


def _builds(tmp_path: Path, count: int) -> tuple[LocalBuilder, list[str]]:
    builder = LocalBuilder(tmp_path / "state" / "artifacts")
    tags = [_build(builder, tmp_path / "repo", version) for version in range(count)]
    assert len(set(tags)) == count
    return builder, tags


def test_keeps_what_is_in_use_and_the_newest_builds_and_deletes_the_rest(tmp_path):
    builder, tags = _builds(tmp_path, 5)
    oldest, in_use = tags[0], tags[1]
    collected = gc.collect(builder, tmp_path / "state" / "logs", {in_use}, set(), keep=2)
    kept = set(builder.tags())
    assert kept == {in_use, tags[3], tags[4]}  # in use, plus the two newest
    assert set(collected.removed_tags) == {oldest, tags[2]}
    assert not builder.path(oldest).exists()
    assert not builder.log_path(oldest).exists()
    assert collected.reclaimed_bytes > 0
    assert builder.is_built(in_use)


def test_a_second_collection_finds_nothing(tmp_path):
    builder, tags = _builds(tmp_path, 3)
    logs = tmp_path / "state" / "logs"
    gc.collect(builder, logs, {tags[0]}, set(), keep=1)
    again = gc.collect(builder, logs, {tags[0]}, set(), keep=1)
    assert again.removed_tags == [] and again.reclaimed_bytes == 0


def test_keep_zero_leaves_only_what_is_in_use(tmp_path):
    builder, tags = _builds(tmp_path, 3)
    gc.collect(builder, tmp_path / "state" / "logs", {tags[1]}, set(), keep=0)
    assert builder.tags() == [tags[1]]


def test_replica_logs_of_gone_functions_go_and_live_ones_stay(tmp_path):
    builder = LocalBuilder(tmp_path / "state" / "artifacts")
    logs = tmp_path / "state" / "logs"
    (logs / "prod").mkdir(parents=True)
    gone = logs / "prod" / "gone.log"
    gone.write_text("old\n")
    live = logs / "prod" / "live.log"
    live.write_bytes(b"a" * 5000 + b"the end\n")
    collected = gc.collect(builder, logs, set(), {("prod", "live")}, keep=3)
    assert not gone.exists()
    # its writer keeps it under the cap (test_log_caps): the collector never cuts it under
    # the writer's feet
    assert live.stat().st_size == 5008
    assert collected.reclaimed_bytes == 4


def test_logs_of_failed_builds_nobody_uses_go(tmp_path):
    builder = LocalBuilder(tmp_path / "state" / "artifacts")
    stray = builder.root / "python3.11-0123456789abcdef.log"
    stray.write_text("pip failed\n")
    used = builder.root / "python3.11-fedcba9876543210.log"
    used.write_text("still shown\n")
    gc.collect(builder, tmp_path / "logs", {"python3.11-fedcba9876543210"}, set(), keep=3)
    assert not stray.exists() and used.exists()
