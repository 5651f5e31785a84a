"""What a look finds, with the watcher's clock in the test's hands: a crash-looping
function is one incident until it has stayed healthy for the grace period."""

from __future__ import annotations

import time
from pathlib import Path

from gitops_sless.notify import Provider
from gitops_sless.notify.watch import GRACE_SEC, Watcher
from gitops_sless.state.store import Store

HOOK = Provider("hook", "webhook", url="http://hook.example")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def look(watcher: Watcher) -> list[str]:
    """The events of one look, delivered at once; their kinds."""
    events = watcher.look([HOOK]).get("hook", [])
    watcher.delivered(events)
    return [event.kind for event in events]


def test_a_crash_looping_function_is_one_incident_until_healthy_for_the_grace(tmp_path: Path):
    store = Store(tmp_path / "status.db")
    clock = Clock()
    watcher = Watcher(store, "http://fn.example", clock=clock)
    said: list[str] = []
    for n in range(12):  # up in one look, in its backoff in the next
        phase = "Failed" if n % 2 == 0 else "Ready"
        store.set_function("prod", "loop", phase=phase, message="crashed" if n % 2 == 0 else "")
        said += look(watcher)
        clock.now += 10
    assert said == ["startFailed"]
    assert look(watcher) == []  # Ready for 10 s
    clock.now += GRACE_SEC - 20
    assert look(watcher) == []  # for 50 s: it may fail again
    clock.now += 20
    events = watcher.look([HOOK])["hook"]  # nothing changed in the store but the time
    assert [(e.kind, e.was) for e in events] == [("resolved", "startFailed")]
    assert events[0].at - events[0].since == 110  # from the first failure to the last


def test_dead_letters_after_the_old_ones_expired_are_said(tmp_path: Path):
    counts = {("prod", "orders"): 5}
    watcher = Watcher(
        Store(tmp_path / "status.db"), "http://fn.example", dead_letters=lambda: dict(counts)
    )
    assert look(watcher) == ["deadLettered"]
    counts.clear()  # retention removed them: the function has none
    assert look(watcher) == []
    counts[("prod", "orders")] = 3
    events = watcher.look([HOOK])["hook"]
    assert [(e.kind, e.count, e.total) for e in events] == [("deadLettered", 3, 3)]


def test_a_function_scaled_to_zero_is_healthy(tmp_path: Path):
    store = Store(tmp_path / "status.db")
    clock = Clock()
    watcher = Watcher(store, "http://fn.example", clock=clock)
    store.set_function("prod", "quiet", phase="Failed", message="crashed")
    assert look(watcher) == ["startFailed"]
    store.set_function("prod", "quiet", phase="Idle", message="")
    assert look(watcher) == []
    clock.now += GRACE_SEC
    assert look(watcher) == ["resolved"]


def serve(store: Store, revision: str) -> None:
    store.set_serving("prod", "greet", {"seed": "{}"}, revision[0] * 40)
    store.set_function(
        "prod", "greet", phase="Ready", serving_revision=revision, revision=revision[0] * 40
    )


def test_a_new_leader_announces_only_the_deploys_after_it_leads(tmp_path: Path):
    store = Store(tmp_path / "status.db")
    watcher = Watcher(store, "http://fn.example")  # the pod starts, and follows
    time.sleep(0.01)
    serve(store, "r1")  # deployed by the leader then: not this replica's to announce
    time.sleep(0.01)
    watcher.follow()  # it looked, not leading
    time.sleep(0.01)
    assert look(watcher) == []  # it leads: its first look
    serve(store, "r2")
    events = watcher.look([HOOK])["hook"]
    assert [(e.kind, e.revision) for e in events] == [("deployed", "r2")]
