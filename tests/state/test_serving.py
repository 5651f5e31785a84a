"""What serves is written down in full: a restart serves the function as it was deployed,
its code and every policy (scale, limits, async), never a default in their place."""

from __future__ import annotations

import dataclasses
import json

from gitops_sless.manifests.model import (
    AsyncPolicy,
    CronTrigger,
    Function,
    Job,
    JobRef,
    RateLimit,
    Rollout,
    Scale,
    SecretRef,
    StreamPolicy,
    Warm,
    WebSocketTrigger,
)
from gitops_sless.plan.backend import deployment_for
from gitops_sless.state import serving

EVERYTHING = Function(
    name="hello",
    folder="hello",
    manifest="hello/sless.yaml",
    runtime="nodejs20",
    entrypoint="handler.main",
    memory_mb=64,
    timeout_sec=7,
    replicas=3,
    enabled=False,
    env={"A": "1", "KEY": SecretRef("api", "key"), "TOKEN": JobRef("seed")},
    preview_env={"B": "2"},
    http=False,
    crons=(CronTrigger("*/5 * * * *", {"tick": True}),),
    jobs=(Job("seed", 2, {"n": 1}, "hello"),),
    source_id="tree-1",
    build_tag="tag-1",
    max_processes=32,
    same_origin=True,
    scale=Scale(0, 4, 3, 12.5, (Warm("0 9 * * 1-5", 3600.0, 1),)),
    preview_scale=Scale(0, 1, 2, 30.0),
    replicas_named=True,
    concurrency=5,
    rate_limit=RateLimit(2.5, 9),
    max_body_bytes=1024,
    async_policy=AsyncPolicy(5, 0.5, 60.0, 600.0, 3),
    subjects=("orders.created", "orders.paid"),
    rollout=Rollout((5, 25, 75), 12.0, 3, 0.2),
    stream=StreamPolicy(4, 40, 7),
    websocket=WebSocketTrigger("hello", "bye", 4096),
    plain_http=False,
)


def test_every_field_of_a_function_is_set_apart_from_its_default_here():
    # so that a field added to Function without a place in the record fails the next test
    defaults = Function(**{f.name: getattr(EVERYTHING, f.name) for f in _required()})
    for field in dataclasses.fields(Function):
        if field not in _required():
            name = field.name
            assert getattr(EVERYTHING, name) != getattr(defaults, name), f"{name} is its default"


def _required() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Function) if f.default is dataclasses.MISSING]


def test_a_record_gives_back_the_function_it_was_written_from():
    deployment = deployment_for("prod", EVERYTHING, {"seed": '{"t": 1}'})
    record = json.loads(json.dumps(serving.to_record(deployment)))  # as the store keeps it
    again = serving.from_record(record)
    assert again.function == EVERYTHING
    assert again.env_vars == deployment.env_vars
    assert again.spec_hash == deployment.spec_hash
    # and it is the same deployment: the plan finds nothing to change
    assert deployment_for("prod", again.function, {"seed": '{"t": 1}'}) == again


def test_a_record_from_before_the_policies_were_kept_is_deployed_again():
    deployment = deployment_for("prod", EVERYTHING, {"seed": '{"t": 1}'})
    record = serving.to_record(deployment)
    old = {**record, "format": 1}
    old["function"] = {
        key: value
        for key, value in record["function"].items()
        if key
        not in (
            "scale",
            "previewScale",
            "replicasNamed",
            "concurrency",
            "rateLimit",
            "maxBodyBytes",
            "async",
            "subjects",
        )
    }
    again = serving.from_record(old)
    assert again.function.scale is None  # not known: its defaults, until the first pass
    # its hash is never the one the plan computes, so the first pass deploys it again
    assert again.spec_hash != deployment.spec_hash
