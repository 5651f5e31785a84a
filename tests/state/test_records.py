"""Records: the write-through copy of one environment's function rows."""

from __future__ import annotations

import random
from pathlib import Path

from gitops_sless.state.records import Records
from gitops_sless.state.store import Store

PHASES = ("Ready", "Disabled", "Pending", "Failed", "Building", "Invalid")


def _unsettled_in(store: Store, env: str) -> dict[str, str]:
    return {
        row["name"]: row["phase"]
        for row in store.functions(env)
        if row["phase"] not in ("Ready", "Disabled")
    }


def test_unsettled_follows_every_write_as_the_store_would_answer(tmp_path: Path) -> None:
    """What a pass's result is made of (the functions not Ready or Disabled) stays what the
    store says through creations, phase changes, deletions and a reload."""
    store = Store(tmp_path / "status.db")
    records = Records(store, "prod")
    other = Records(store, "pr-1")
    other.update("elsewhere", phase="Failed")  # another environment's rows never count
    rng = random.Random(7)
    for step in range(400):
        name = f"f{rng.randrange(30)}"
        if rng.random() < 0.15:
            records.delete(name)
        else:
            records.update(name, phase=rng.choice(PHASES), message=f"step {step}")
        if step % 97 == 0:
            records.reload()
        got = {name: row["phase"] for name, row in records.unsettled().items()}
        assert got == _unsettled_in(store, "prod"), f"step {step}"
    assert list(records.unsettled()) == sorted(records.unsettled())
