"""Issue 27, the manifest side: ``scale``, ``concurrency``, ``rateLimit`` and ``maxBodyBytes``
load with their defaults, bad ones are refused at their file:line and field, and the spec hash
and the plan's diff follow them (without ever changing the hash of a function that has none)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest

from gitops_sless.manifests import durations
from gitops_sless.manifests import load as manifest
from gitops_sless.manifests.model import (
    DesiredState,
    Function,
    RateLimit,
    Scale,
    StreamPolicy,
    Warm,
    env_as_written,
)
from gitops_sless.plan import diff
from gitops_sless.plan.backend import deployment_for
from gitops_sless.source.snapshot import DirectorySnapshot
from gitops_sless.web.diffs import DiffRequest

from .test_manifest import M, one, problem_lines

DURATION_HINT = (
    "must be a duration: whole numbers with units d, h, m, s, each at most once and in that "
    "order (90s, 5m, 1h30m, 2d), or a whole number of seconds"
)


def load_one(write_repo, *extra: str) -> Function:
    state = manifest.load(DirectorySnapshot(write_repo(one(*extra))))
    assert problem_lines(state) == []
    return state.functions["fn"]


def problems_of(write_repo, *extra: str) -> list[str]:
    state = manifest.load(DirectorySnapshot(write_repo(one(*extra))))
    assert state.functions == {}
    return problem_lines(state)


# --- defaults ------------------------------------------------------------------------------------


def test_a_function_without_scale_runs_one_fixed_replica_and_a_preview_scales_to_zero(
    write_repo,
):
    fn = load_one(write_repo)
    assert (fn.scale, fn.preview_scale, fn.replicas, fn.replicas_named) == (None, None, 1, False)
    assert fn.scale_in("prod") == Scale.fixed(1)
    assert not fn.scale_in("prod").autoscaled
    assert fn.scale_in("pr-7") == Scale(0, 1)
    assert (fn.concurrency, fn.rate_limit, fn.max_body_bytes) == (0, None, None)


def test_replicas_written_is_fixed_in_previews_too(write_repo):
    fn = load_one(write_repo, "    replicas: 3")
    assert fn.replicas_named is True
    assert fn.scale_in("prod") == fn.scale_in("pr-1") == Scale.fixed(3)


def test_replicas_written_as_the_default_still_counts_as_written(write_repo):
    fn = load_one(write_repo, "    replicas: 1")
    assert fn.replicas_named is True
    assert fn.scale_in("pr-1") == Scale.fixed(1)


def test_an_empty_scale_block_is_every_default(write_repo):
    fn = load_one(write_repo, "    scale: {}")
    assert fn.scale == Scale(0, 10, 10, 300.0, ())
    assert fn.scale_in("prod") == fn.scale_in("pr-2") == fn.scale  # previews take it too
    assert fn.replicas_named is False


def test_every_scale_field_loads(write_repo):
    fn = load_one(
        write_repo,
        "    scale:",
        "      min: 1",
        "      max: 20",
        "      target: 4",
        "      idle: 60s",
        "      warm:",
        '        - {cron: "0 8 * * 1-5", for: 10h, min: 2}',
        "        - {cron: '*/30 * * * *', for: 120, min: 20}",
        "    concurrency: 20",
        "    rateLimit: {rps: 50, burst: 100}",
        "    maxBodyBytes: 1048576",
    )
    warm = (Warm("0 8 * * 1-5", 36000.0, 2), Warm("*/30 * * * *", 120.0, 20))
    assert fn.scale == Scale(1, 20, 4, 60.0, warm)
    assert fn.scale_in("prod").autoscaled
    assert fn.concurrency == 20
    assert fn.rate_limit == RateLimit(50.0, 100)
    assert fn.max_body_bytes == 1048576


def test_preview_scale_wins_in_previews_only(write_repo):
    fn = load_one(
        write_repo,
        "    scale: {min: 2, max: 8}",
        "    preview:",
        "      scale: {max: 1}",
    )
    assert fn.scale_in("prod") == Scale(2, 8)
    assert fn.scale_in("pr-3") == fn.preview_scale == Scale(0, 1)


def test_preview_scale_beside_replicas_is_allowed_and_wins_in_previews(write_repo):
    fn = load_one(write_repo, "    replicas: 3", "    preview:", "      scale: {min: 0, max: 2}")
    assert fn.scale_in("prod") == Scale.fixed(3)
    assert fn.scale_in("pr-3") == Scale(0, 2)


def test_a_scale_with_min_equal_to_max_is_a_fixed_count(write_repo):
    fn = load_one(write_repo, "    scale: {min: 3, max: 3}")
    assert not fn.scale_in("prod").autoscaled
    assert fn.scale_in("pr-1") == Scale(3, 3)


@pytest.mark.parametrize(
    ("written", "burst"),
    [
        pytest.param("{rps: 50}", 50, id="whole"),
        pytest.param("{rps: 2.5}", 3, id="rounded-up"),
        pytest.param("{rps: 0.5}", 1, id="fraction"),
        pytest.param("{rps: 0.5, burst: 10}", 10, id="written"),
    ],
)
def test_burst_defaults_to_rps_rounded_up(write_repo, written: str, burst: int):
    assert load_one(write_repo, f"    rateLimit: {written}").rate_limit.burst == burst


# --- durations -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "seconds"),
    [
        ("90s", 90),
        ("5m", 300),
        ("10h", 36000),
        ("1h30m", 5400),
        ("2d", 172800),
        ("1d2h3m4s", 93784),
        ("0s", 0),
        (120, 120),
        (120.0, 120),
    ],
)
def test_durations_parse(written: str | int, seconds: int):
    assert durations.parse(written) == seconds


@pytest.mark.parametrize(
    "written", ["", "90", "1m30h", "5 m", "1.5h", "1h1h", "5M", "m", "-5s", 1.5, True]
)
def test_durations_that_do_not_parse(written: Any):
    with pytest.raises(durations.DurationError):
        durations.parse(written)


@pytest.mark.parametrize(
    ("seconds", "shown"), [(300, "5m"), (5400, "1h30m"), (90, "1m30s"), (604800, "7d"), (0, "0s")]
)
def test_durations_are_shown_as_a_manifest_writes_them(seconds: float, shown: str):
    assert durations.shown(seconds) == shown


@pytest.mark.parametrize(
    ("idle", "seconds"), [("90s", 90.0), ("5m", 300.0), ("1h30m", 5400.0), ("120", 120.0)]
)
def test_idle_loads_in_seconds(write_repo, idle: str, seconds: float):
    assert load_one(write_repo, f"    scale: {{idle: {idle}}}").scale.idle_sec == seconds


def bad(id: str, extra: list[str], *expected: str) -> Any:
    return pytest.param(extra, list(expected), id=id)


BAD_CASES = [
    bad(
        "replicas-and-scale",
        ["    replicas: 3", "    scale:", "      max: 5"],
        f"{M}:6: functions[0].scale: a function names replicas or scale, not both "
        "(replicas: N is scale min N, max N)",
    ),
    bad(
        "min-above-max",
        ["    scale: {min: 4, max: 3}"],
        f"{M}:5: functions[0].scale.min: 4 is more than max 3",
    ),
    bad(
        "min-above-the-default-max",
        ["    scale:", "      min: 11"],
        f"{M}:6: functions[0].scale.min: 11 is more than max 10 (the default)",
    ),
    bad(
        "preview-min-above-max",
        ["    preview:", "      scale:", "        min: 2", "        max: 1"],
        f"{M}:7: functions[0].preview.scale.min: 2 is more than max 1",
    ),
    bad(
        "warm-above-max",
        [
            "    scale:",
            "      max: 3",
            "      warm:",
            "        - {cron: '0 8 * * *', for: 1h, min: 4}",
        ],
        f"{M}:8: functions[0].scale.warm[0].min: 4 is more than max 3: a floor never exceeds max",
    ),
    bad(
        "warm-cron-day-of-week-7",
        [
            "    scale:",
            "      warm:",
            "        - cron: '0 8 * * 7'",
            "          for: 1h",
            "          min: 1",
        ],
        f"{M}:7: functions[0].scale.warm[0].cron: day-of-week field: 7 is out of range 0..6 "
        "(0 = Sunday; use 0, not 7)",
    ),
    bad(
        "warm-cron-three-fields",
        ["    scale: {warm: [{cron: '* * *', for: 1h, min: 1}]}"],
        f"{M}:5: functions[0].scale.warm[0].cron: '* * *' has 3 fields; a schedule has five: "
        "minute hour day-of-month month day-of-week",
    ),
    bad(
        "idle-units-out-of-order",
        ["    scale:", "      idle: 1m30h"],
        f'{M}:6: functions[0].scale.idle: "1m30h" {DURATION_HINT}',
    ),
    bad(
        "idle-without-unit-as-a-string",
        ["    scale:", "      idle: '90'"],
        f'{M}:6: functions[0].scale.idle: "90" {DURATION_HINT}',
    ),
    bad(
        "idle-empty",
        ["    scale:", "      idle: ''"],
        f"{M}:6: functions[0].scale.idle: must not be empty",
    ),
    bad(
        "idle-zero-seconds",
        ["    scale:", "      idle: 0s"],
        f'{M}:6: functions[0].scale.idle: "0s" is less than the minimum of 1s',
    ),
    bad(
        "idle-zero",
        ["    scale:", "      idle: 0"],
        f"{M}:6: functions[0].scale.idle: 0 is less than the minimum of 1",
    ),
    bad(
        "idle-over-a-day",
        ["    scale:", "      idle: 1d1s"],
        f'{M}:6: functions[0].scale.idle: "1d1s" is greater than the maximum of 1d',
    ),
    bad(
        "idle-a-fraction",
        ["    scale:", "      idle: 1.5"],
        f"{M}:6: functions[0].scale.idle: 1.5 is a number; expected a string or a whole number",
    ),
    bad(
        "warm-for-over-a-week",
        ["    scale: {warm: [{cron: '0 8 * * *', for: 8d, min: 1}]}"],
        f'{M}:5: functions[0].scale.warm[0].for: "8d" is greater than the maximum of 7d',
    ),
    bad(
        "warm-for-over-a-week-in-seconds",
        ["    scale: {warm: [{cron: '0 8 * * *', for: 604801, min: 1}]}"],
        f"{M}:5: functions[0].scale.warm[0].for: 604801 is greater than the maximum of 604800",
    ),
    bad(
        "warm-for-missing",
        ["    scale:", "      warm:", "        - {cron: '0 8 * * *', min: 1}"],
        f"{M}:7: functions[0].scale.warm[0].for: is required",
    ),
    bad(
        "rate-limit-zero",
        ["    rateLimit: {rps: 0}"],
        f"{M}:5: functions[0].rateLimit.rps: 0 is less than or equal to the minimum of 0",
    ),
    bad(
        "burst-zero",
        ["    rateLimit: {rps: 1, burst: 0}"],
        f"{M}:5: functions[0].rateLimit.burst: 0 is less than the minimum of 1",
    ),
    bad(
        "max-body-zero",
        ["    maxBodyBytes: 0"],
        f"{M}:5: functions[0].maxBodyBytes: 0 is less than the minimum of 1",
    ),
    bad(
        "concurrency-negative",
        ["    concurrency: -1"],
        f"{M}:5: functions[0].concurrency: -1 is less than the minimum of 0",
    ),
    bad(
        "every-problem-of-one-block-at-once",
        [
            "    scale:",
            "      min: 11",
            "      idle: 0s",
            "      warm:",
            "        - {cron: '0 8 * * 7', for: 8d, min: 12}",
        ],
        f"{M}:6: functions[0].scale.min: 11 is more than max 10 (the default)",
        f'{M}:7: functions[0].scale.idle: "0s" is less than the minimum of 1s',
        f"{M}:9: functions[0].scale.warm[0].cron: day-of-week field: 7 is out of range 0..6 "
        "(0 = Sunday; use 0, not 7)",
        f'{M}:9: functions[0].scale.warm[0].for: "8d" is greater than the maximum of 7d',
        f"{M}:9: functions[0].scale.warm[0].min: 12 is more than max 10 (the default): "
        "a floor never exceeds max",
    ),
    bad(
        "a-bad-field-hides-no-bad-schedule",
        ["    scale:", "      max: lots", "      warm: [{cron: '0 8 * * 7', for: 1h, min: 1}]"],
        f'{M}:6: functions[0].scale.max: "lots" is a string; expected a whole number',
        f"{M}:7: functions[0].scale.warm[0].cron: day-of-week field: 7 is out of range 0..6 "
        "(0 = Sunday; use 0, not 7)",
    ),
]


@pytest.mark.parametrize(("extra", "expected"), BAD_CASES)
def test_bad_scaling_is_refused_at_its_line_and_field(
    write_repo, extra: list[str], expected: list[str]
):
    assert problems_of(write_repo, *extra) == expected


# --- the spec hash -------------------------------------------------------------------------------


def hash_before_issue_27(env: str, fn: Function) -> str:
    """The spec hash as ``deployment_for`` computed it before issue 27 (no job results)."""
    spec = {
        "tag": fn.build_tag,
        "runtime": fn.runtime,
        "entrypoint": fn.entrypoint,
        "memoryMB": fn.memory_mb,
        "maxProcesses": fn.max_processes,
        "timeoutSec": fn.timeout_sec,
        "replicas": fn.replicas,
        "enabled": fn.enabled,
        "http": fn.http,
        "crons": [{"schedule": c.schedule, "event": dict(c.event)} for c in fn.crons],
        "env": env_as_written(fn.env_for(env)),
    }
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


HTTP_AND_CRON = [
    "    memoryMB: 256",
    "    env: {A: b, S: {secret: s, key: k}}",
    "    triggers:",
    "      - type: http",
    "      - {type: cron, schedule: '0 2 * * *', event: {x: 1}}",
]


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="defaults"),
        pytest.param(["    replicas: 3", *HTTP_AND_CRON], id="replicas-http-cron"),
        pytest.param(["    replicas: 0", "    enabled: false"], id="disabled"),
    ],
)
def test_a_function_without_the_new_fields_keeps_its_production_hash(write_repo, extra):
    fn = load_one(write_repo, *extra)
    assert deployment_for("prod", fn, {}).spec_hash == hash_before_issue_27("prod", fn)


def test_replicas_written_keeps_its_preview_hash_too(write_repo):
    fn = load_one(write_repo, "    replicas: 2")
    assert deployment_for("pr-4", fn, {}).spec_hash == hash_before_issue_27("pr-4", fn)


def test_a_fixed_scale_hashes_as_the_same_replicas(write_repo):
    fixed = load_one(write_repo, "    scale: {min: 3, max: 3}")
    assert deployment_for("prod", fixed, {}).spec_hash == hash_before_issue_27(
        "prod", replace(fixed, replicas=3)
    )


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"scale": Scale(0, 10)}, id="autoscaled"),
        pytest.param({"scale": Scale(0, 10, idle_sec=60.0)}, id="idle"),
        pytest.param({"scale": Scale(0, 10, target=5)}, id="target"),
        pytest.param({"scale": Scale(1, 1, warm=(Warm("0 8 * * *", 3600.0, 1),))}, id="warm"),
        pytest.param({"scale": Scale.fixed(2)}, id="fixed-count"),
        pytest.param({"concurrency": 5}, id="concurrency"),
        pytest.param({"rate_limit": RateLimit(1.0, 1)}, id="rate-limit"),
        pytest.param({"max_body_bytes": 1024}, id="max-body"),
        pytest.param({"stream": StreamPolicy()}, id="stream"),
    ],
)
def test_each_new_field_changes_the_production_hash(write_repo, change: dict[str, Any]):
    fn = load_one(write_repo)
    before = deployment_for("prod", fn, {}).spec_hash
    assert deployment_for("prod", replace(fn, **change), {}).spec_hash != before


def test_preview_scale_changes_the_preview_hash_only(write_repo):
    fn = load_one(write_repo, "    scale: {max: 4}")
    changed = replace(fn, preview_scale=Scale(0, 2))
    assert deployment_for("prod", changed, {}).spec_hash == deployment_for("prod", fn, {}).spec_hash
    assert deployment_for("pr-1", changed, {}).spec_hash != deployment_for("pr-1", fn, {}).spec_hash


def test_the_diff_request_carries_every_new_field(write_repo):
    """``gitops-sless diff`` sends the functions it loaded: the server must hash them as the
    reconciler would, or every function with a scale block would read as changed."""
    root = write_repo(
        one(
            "    scale: {min: 1, max: 4, idle: 90s, warm: [{cron: '0 8 * * *', for: 1h, min: 2}]}",
            "    concurrency: 3",
            "    rateLimit: {rps: 0.5}",
            "    maxBodyBytes: 2048",
            "    stream: {idleSec: 7}",
            "    preview:",
            "      scale: {max: 1}",
        )
    )
    state = manifest.load(DirectorySnapshot(root))
    sent = DiffRequest.model_validate(DiffRequest.from_state(state).model_dump(mode="json"))
    fn, received = state.functions["fn"], sent.desired_state().functions["fn"]
    assert received == fn
    for env in ("prod", "pr-1"):
        assert deployment_for(env, received, {}).spec_hash == deployment_for(env, fn, {}).spec_hash


# --- the plan's diff -----------------------------------------------------------------------------


def changed_fields(old: Function, new: Function, env: str = "prod") -> list[tuple[Any, ...]]:
    """The fields the plan's diff reports for ``old`` running and ``new`` declared."""
    state = DesiredState("r2", {new.name: new})
    records = [{"name": old.name, "spec": {"hash": deployment_for(env, old, {}).spec_hash}}]
    builds = {new.build_tag: {"phase": "Succeeded", "error": None}}
    out = diff.compute(state, env, records, builds, [], running={old.name: old})
    if not out.changed:
        return []
    (fn,) = out.changed
    return [(f.field, f.old, f.new) for f in fn.fields]


@pytest.fixture
def fn(write_repo) -> Function:
    return load_one(write_repo, "    triggers: [{type: http}]")


def test_a_new_fixed_count_reads_as_replicas(fn):
    assert changed_fields(fn, replace(fn, replicas=3)) == [("replicas", "1", "3")]


def test_a_scale_block_reads_as_scale(fn):
    warm = (Warm("0 8 * * 1-5", 36000.0, 2),)
    new = replace(fn, scale=Scale(0, 10, 10, 300.0, warm))
    assert changed_fields(fn, new) == [
        (
            "scale",
            "1 replica (fixed)",
            "0..10 replicas, target 10 in flight, idle 5m, warm 2 from '0 8 * * 1-5' for 10h",
        )
    ]


def test_an_idle_change_reads_as_scale(fn):
    old = replace(fn, scale=Scale(0, 3))
    new = replace(fn, scale=Scale(0, 3, idle_sec=5400.0))
    assert changed_fields(old, new) == [
        (
            "scale",
            "0..3 replicas, target 10 in flight, idle 5m",
            "0..3 replicas, target 10 in flight, idle 1h30m",
        )
    ]


def test_a_preview_reads_its_own_scale(fn):
    new = replace(fn, preview_scale=Scale(0, 2))
    assert changed_fields(fn, new, "prod") == []
    assert changed_fields(fn, new, "pr-1") == [
        (
            "scale",
            "0..1 replicas, target 10 in flight, idle 5m",
            "0..2 replicas, target 10 in flight, idle 5m",
        )
    ]


def test_the_proxy_limits_read_in_words(fn):
    new = replace(fn, concurrency=20, rate_limit=RateLimit(0.5, 1), max_body_bytes=1048576)
    assert changed_fields(fn, new) == [
        ("concurrency", "no limit", "20 in flight per replica"),
        ("rateLimit", "no limit", "0.5 requests/s, burst 1"),
        ("maxBodyBytes", "the proxy's limit", "1048576 bytes"),
    ]
    assert changed_fields(new, fn) == [
        ("concurrency", "20 in flight per replica", "no limit"),
        ("rateLimit", "0.5 requests/s, burst 1", "no limit"),
        ("maxBodyBytes", "1048576 bytes", "the proxy's limit"),
    ]


def test_a_stream_block_reads_as_stream_even_with_the_defaults(fn):
    # named, the limits are given to the runtime: another spec, which the diff must show
    assert changed_fields(fn, replace(fn, stream=StreamPolicy())) == [
        (
            "stream",
            "not set (the runtime's idle 30s, at most 900s, drain 30s)",
            "idle 30s, at most 900s, drain 30s",
        )
    ]
    assert changed_fields(fn, replace(fn, stream=StreamPolicy(5, 60))) == [
        (
            "stream",
            "not set (the runtime's idle 30s, at most 900s, drain 30s)",
            "idle 5s, at most 60s, drain 30s",
        )
    ]


def test_a_new_rate_reads_as_rate_limit(fn):
    old = replace(fn, rate_limit=RateLimit(50.0, 50))
    new = replace(fn, rate_limit=RateLimit(50.0, 100))
    assert changed_fields(old, new) == [
        ("rateLimit", "50 requests/s, burst 50", "50 requests/s, burst 100")
    ]
