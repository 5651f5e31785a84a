"""The ``engine`` fixture: a started queue engine of each kind, closed after the test.

An engine is added to the contract tests by a factory in :data:`ENGINES`: it gets the
test's request (to ask for other fixtures, such as a server) and an empty folder,
and returns the engine, not yet started.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gitops_sless.invocations.engine import Engine
from gitops_sless.invocations.nats import NatsEngine
from gitops_sless.invocations.sqlite import SqliteEngine

from ..natsserver import nats_server  # noqa: F401 - a NATS server with JetStream, per test

Factory = Callable[[pytest.FixtureRequest, Path], Engine]


def _sqlite(request: pytest.FixtureRequest, folder: Path) -> Engine:
    return SqliteEngine(folder / "invocations.db")


def _nats(request: pytest.FixtureRequest, folder: Path) -> Engine:
    return NatsEngine(request.getfixturevalue("nats_server").url)


ENGINES: dict[str, Factory] = {
    "sqlite": _sqlite,
    "nats": _nats,
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=sorted(ENGINES))
async def engine(
    request: pytest.FixtureRequest, tmp_path: Path, anyio_backend: str
) -> AsyncIterator[Engine]:
    made = ENGINES[request.param](request, tmp_path)
    await made.start()
    try:
        yield made
    finally:
        await made.close()
