"""The Gateway API's published schema, from Python: objects checked by the npm package
``@kubernetes-models/gateway-api`` (its models' ``validate()``, generated from the upstream
CRDs), through ``node tests/gateway_validate.mjs``. ``scripts/setup`` installs the package
(``npm ci`` in tests/)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "gateway_validate.mjs"
PACKAGE = HERE / "node_modules" / "@kubernetes-models" / "gateway-api"


def schema_errors(objects: Iterable[dict[str, Any]]) -> list[str | None]:
    """For each object, None when the schema accepts it, else what the schema says."""
    batch = list(objects)
    assert PACKAGE.is_dir(), "run scripts/setup --tests: it installs tests/node_modules (npm ci)"
    done = subprocess.run(
        ["node", str(SCRIPT)],
        input=json.dumps(batch),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answers: list[str | None] = json.loads(done.stdout)
    assert len(answers) == len(batch)
    return answers


def assert_valid(objects: Iterable[dict[str, Any]]) -> None:
    batch = list(objects)
    errors = schema_errors(batch)
    bad = {
        f"{o['kind']}/{o['metadata']['name']}": e for o, e in zip(batch, errors, strict=True) if e
    }
    assert not bad, bad
