"""natsacks.Acks against a real NATS server: what each way a JetStream publish can
go wrong says (the engine turns these into a 503 with the reason, or a Conflict)."""

from __future__ import annotations

import nats
import pytest

from gitops_sless.invocations.engine import EngineUnavailable
from gitops_sless.invocations.natsacks import Acks, Conflict

from ..natsserver import NatsServer, nats_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.anyio


async def test_each_failed_publish_says_why(nats_server: NatsServer) -> None:  # noqa: F811
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="PROBE", subjects=["probe.>"])
        acks = Acks(nc, 0.5)
        await acks.start()
        assert await acks.publish("probe.a", b"1", {}, "probe a") == 1

        with pytest.raises(EngineUnavailable, match=r"NATS: nowhere: no responders"):
            await acks.publish("nowhere.a", b"1", {}, "nowhere")

        expect = {"Nats-Expected-Last-Subject-Sequence": "7"}
        with pytest.raises(Conflict, match="compare a"):
            await acks.publish("probe.a", b"2", expect, "compare a")

        other = {"Nats-Expected-Stream": "ELSEWHERE"}
        said = r"NATS: wrong stream: 'expected stream does not match'"
        with pytest.raises(EngineUnavailable, match=said):
            await acks.publish("probe.a", b"3", other, "wrong stream")

        await nc.subscribe("silent.a")  # takes the message, never answers
        with pytest.raises(EngineUnavailable, match=r"NATS: silent: no answer within 0.5s"):
            await acks.publish("silent.a", b"4", {}, "silent")

        waiting = await acks.send("silent.a", b"5", {}, "cut")
        acks.fail_all("NATS: disconnected before the answer")
        with pytest.raises(EngineUnavailable, match="disconnected before the answer"):
            await acks.stored(waiting, "cut")
    finally:
        await nc.close()
