"""The operator's notification file (``serve --notify-config``), checked against
``schemas/notify.schema.json``, with the secrets it names read from ``--secrets-dir``.

A provider's address is a secret (a Slack or Teams webhook URL is all it takes to post
to the channel): it is read from a file under the secrets folder (``urlSecret``) or,
discouraged, written in the file (``url``); either way it is registered with the log
handler, so no log line shows it, and it never appears in the status API.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .. import logs, paths

__all__ = ["EVENTS", "NotifyConfig", "NotifyConfigError", "Provider", "load"]

# what a provider may ask for; "resolved" goes wherever the failure it ends went
EVENTS = (
    "deployed",
    "buildFailed",
    "startFailed",
    "jobFailed",
    "rolledBack",
    "previewReady",
    "previewClosed",
    "deadLettered",
)
INCIDENTS = ("buildFailed", "startFailed", "jobFailed")


class NotifyConfigError(ValueError):
    """The file cannot be used: it names the file, the field and the rule."""


@dataclass(frozen=True)
class Provider:
    name: str
    kind: str  # webhook | slack | teams | forge
    url: str | None = field(default=None, repr=False)  # a secret: never shown
    hmac_key: bytes | None = field(default=None, repr=False)
    events: tuple[str, ...] = EVENTS
    environments: tuple[str, ...] = ("*",)
    functions: tuple[str, ...] = ("*",)
    max_per_minute: int = 20
    timeout_sec: float = 10.0

    def wants(self, event: str, env: str, function: str | None) -> bool:
        """Whether ``event`` of ``function`` in ``env`` goes to this provider."""
        if event not in self.events:
            return False
        if not any(fnmatch.fnmatchcase(env, glob) for glob in self.environments):
            return False
        return function is None or any(fnmatch.fnmatchcase(function, g) for g in self.functions)

    def hears_of(self, env: str, function: str | None) -> bool:
        """Whether any event of ``function`` in ``env`` may go to this provider."""
        return any(self.wants(event, env, function) for event in self.events)


@dataclass(frozen=True)
class NotifyConfig:
    providers: tuple[Provider, ...] = ()

    @property
    def forge(self) -> bool:
        """Whether rollouts are reported to the forge (commit statuses, a PR comment)."""
        return any(p.kind == "forge" for p in self.providers)


DEFAULT = NotifyConfig((Provider("forge", "forge", events=("rolledBack",)),))


def schema_path() -> Path:
    return paths.home() / "schemas" / "notify.schema.json"


def load(path: Path | None, secrets_dir: Path | None) -> NotifyConfig:
    """The providers ``path`` names (without a file: the forge, as before notifications).

    NotifyConfigError when the file cannot be read, breaks the schema, or names a
    secret that is not there."""
    if path is None:
        return DEFAULT
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise NotifyConfigError(_unparsable(path, exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NotifyConfigError(f"{path}: cannot be read: {exc}") from exc
    problems = check(data)
    if problems:
        raise NotifyConfigError(f"{path}: " + "; ".join(problems))
    providers = tuple(_provider(path, item, secrets_dir) for item in data["providers"])
    names = [p.name for p in providers]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise NotifyConfigError(f"{path}: providers: {', '.join(twice)} named twice")
    return NotifyConfig(providers)


def _unparsable(path: Path, exc: yaml.YAMLError) -> str:
    """Where the YAML broke and the rule, without PyYAML's quote of the line (an inline
    ``url`` is a secret)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{where}: not valid YAML: {problem}"


def check(data: Any) -> list[str]:
    """Every way ``data`` breaks the schema, one line each: ``providers[0].kind: ...``."""
    schema = json.loads(schema_path().read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    found = []
    for error in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.path))):
        where = _where(error.absolute_path)
        hint = error.schema.get("x-pattern-hint") if error.validator == "pattern" else None
        said = f"{error.instance!r} {hint}" if hint else error.message
        if error.validator in ("oneOf", "not") and isinstance(error.instance, dict):
            said = _exclusive(error.instance)
        elif list(error.absolute_path)[-1:] == ["url"]:  # an address is a secret: not echoed
            said = hint or "must be an http:// or https:// URL"
        found.append(f"{where}: {said}" if where else said)
    return found


def _exclusive(item: dict[str, Any]) -> str:
    if item.get("kind") == "forge":
        return "a forge provider takes no url, urlSecret or hmacSecret (it uses --forge-token)"
    if "hmacSecret" in item and item.get("kind") != "webhook":
        return f"hmacSecret is for webhook providers, not {item.get('kind')}"
    return "exactly one of url and urlSecret is required"


def _where(path: Sequence[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _provider(path: Path, item: dict[str, Any], secrets_dir: Path | None) -> Provider:
    name = item["name"]
    url = item.get("url")
    if "urlSecret" in item:
        url = _secret(path, name, item["urlSecret"], secrets_dir).decode("utf-8", "replace")
        if not url.startswith(("http://", "https://")):
            raise NotifyConfigError(
                f"{path}: provider {name}: urlSecret {item['urlSecret']}: not an http(s) URL"
            )
    if url:
        logs.register_secret(url)  # never printed in a log
    key = _secret(path, name, item["hmacSecret"], secrets_dir) if "hmacSecret" in item else None
    return Provider(
        name=name,
        kind=item["kind"],
        url=url,
        hmac_key=key,
        events=tuple(item.get("events", EVENTS)),
        environments=tuple(item.get("environments", ("*",))),
        functions=tuple(item.get("functions", ("*",))),
        max_per_minute=item.get("maxPerMinute", 20),
        timeout_sec=float(item.get("timeoutSeconds", 10)),
    )


def _secret(path: Path, provider: str, name: str, secrets_dir: Path | None) -> bytes:
    if secrets_dir is None:
        raise NotifyConfigError(f"{path}: provider {provider}: secret {name!r} needs --secrets-dir")
    file = secrets_dir / name
    try:
        value = file.read_bytes().strip()
    except OSError as exc:
        raise NotifyConfigError(
            f"{path}: provider {provider}: secret {name!r} cannot be read from "
            f"{secrets_dir}: {exc.strerror or exc}"
        ) from exc
    if not value:
        raise NotifyConfigError(f"{path}: provider {provider}: secret {name!r} is empty")
    logs.register_secret(value.decode("utf-8", "replace"))
    return value
