"""schemathesis against a running server, as a peer tool would run it (issue 33 item 20):
every operation of the live ``/openapi.json`` (the invocation API included), with every
check schemathesis has. Besides no 5xx and answers as declared, that is
``positive_data_acceptance`` (a body the published schema allows is not refused) and
``negative_data_rejection`` (one it forbids is not taken): the schema a client reads is
the one the server enforces.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS

from ..sless_server import TOKEN
from ..test_serve import git_daemon, git_root, http_function, setup

__all__ = ["git_daemon", "git_root", "setup"]  # the fixtures, shared with test_serve

EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# what the store holds, so that answers are not all 404
KNOWN = {"env": "prod", "name": "greet", "forge": "github"}


@pytest.fixture
def live_schema(setup):
    setup.push(http_function("greet", "hello"))
    server = setup.serve()
    server.wait(lambda: (server.function("greet") or {}).get("phase") == "Ready", "greet Ready")
    token = {"Authorization": f"Bearer {TOKEN}"}
    return schemathesis.openapi.from_url(f"{server.base}/openapi.json", headers=token)


def _cases(operation, path: str) -> st.SearchStrategy:
    known = {key: value for key, value in KNOWN.items() if "{" + key + "}" in path}
    strategies = [operation.as_strategy(mode) for mode in GenerationMode]
    token = {"Authorization": f"Bearer {TOKEN}"}
    strategies.append(operation.as_strategy(headers=token, path_parameters=known or None))
    return st.one_of(strategies)


def test_every_operation_passes_every_check(live_schema):
    operations = [result.ok() for result in live_schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert "/api/v1/invocations" in paths and "/api/v1/environments/{env}/diff" in paths
    checks = CHECKS.get_all()
    failures: list[str] = []
    for operation in operations:

        @given(case=_cases(operation, operation.path))
        @EXAMPLES
        def call(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=checks)

        try:
            call()
        except (AssertionError, BaseExceptionGroup) as exc:  # run every one, show all
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}"[:2000])
    assert not failures, "\n\n".join(failures)
