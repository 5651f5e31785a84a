"""The sless.yaml reference of the README, generated from the schema.

``python -m gitops_sless.manifests.reference`` prints it; a test keeps the README's copy
equal to it, so the documentation cannot drift from what validation enforces.
"""

from __future__ import annotations

from typing import Any

from . import durations
from .schema import load_schema

__all__ = ["markdown"]

_SECTIONS = [
    ("Function (`functions[]`)", "function"),
    ("Secret reference (env value)", "secretRef"),
    ("Job-result reference (env value)", "jobRef"),
    ("Scale (`scale`, `preview.scale`)", "scale"),
    ("Warm floor (`scale.warm[]`)", "warm"),
    ("Rate limit (`rateLimit`)", "rateLimit"),
    ("HTTP trigger (`triggers[]`, `type: http`)", "httpTrigger"),
    ("Cron trigger (`triggers[]`, `type: cron`)", "cronTrigger"),
    ("Job (`jobs[]`)", "job"),
]


def _resolve(prop: dict[str, Any]) -> dict[str, Any]:
    defs = load_schema()["$defs"]
    while "$ref" in prop:
        target = defs[prop["$ref"].removeprefix("#/$defs/")]
        prop = {**target, **{k: v for k, v in prop.items() if k != "$ref"}}
    return prop


def _is_duration(prop: dict[str, Any]) -> bool:
    return prop.get("pattern") == load_schema()["$defs"]["duration"]["pattern"]


def _kind(prop: dict[str, Any], name: str) -> str:
    if name == "env":
        return "map of env values"
    if "const" in prop:
        return f"`{prop['const']}`"
    if _is_duration(prop):
        return "duration"
    return {"object": "mapping", "array": "list"}.get(prop.get("type", ""), prop.get("type", "-"))


def _bounds(prop: dict[str, Any]) -> str:
    show = durations.shown if _is_duration(prop) else str
    high = show(prop["maximum"]) if "maximum" in prop else ""
    if "exclusiveMinimum" in prop:
        return f"> {show(prop['exclusiveMinimum'])}" + (f", at most {high}" if high else "")
    return f"{show(prop['minimum']) if 'minimum' in prop else ''}..{high}"


def _allowed(prop: dict[str, Any]) -> str:
    parts = []
    if "enum" in prop:
        parts.append(", ".join(f"`{v}`" for v in prop["enum"]))
    if {"minimum", "exclusiveMinimum", "maximum"} & set(prop):
        parts.append(_bounds(prop))
    if "x-pattern-hint" in prop:
        parts.append(prop["x-pattern-hint"])
    if "maxLength" in prop and not _is_duration(prop):
        parts.append(f"at most {prop['maxLength']} characters")
    if "maxItems" in prop:
        parts.append(f"at most {prop['maxItems']} items")
    return "; ".join(parts) or "-"


def _default(prop: dict[str, Any]) -> str:
    if "default" not in prop:
        return "-"
    value = prop["default"]
    text = {True: "true", False: "false"}.get(value, value) if isinstance(value, bool) else value
    return f"`{text}`"


def _table(definition: dict[str, Any]) -> list[str]:
    required = set(definition.get("required", []))
    rows = [
        "| field | type | required | default | allowed | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for name, raw in definition.get("properties", {}).items():
        prop = _resolve(raw)
        meaning = prop.get("description", "").replace("|", "\\|").replace("\n", " ")
        rows.append(
            f"| `{name}` | {_kind(prop, name)} | {'yes' if name in required else 'no'} | "
            f"{_default(prop)} | {_allowed(prop)} | {meaning} |"
        )
    return rows


def markdown() -> str:
    """The reference, as Markdown."""
    schema = load_schema()
    env = schema["$defs"]["env"]
    functions = schema["properties"]["functions"]
    lines = [
        f"A `sless.yaml` holds `functions:`, a list of {functions['minItems']}"
        f" to {functions['maxItems']} functions. {schema['description']}",
        "",
        f"**Env**: {env['description']} Values: {schema['$defs']['envValue']['description']} "
        "Numbers and booleans are refused: quote them.",
        "",
        f"**Durations** (`idle`, `for`): {schema['$defs']['duration']['description']}",
    ]
    for title, name in _SECTIONS:
        definition = _resolve(schema["$defs"][name])
        lines += ["", f"#### {title}", ""]
        if definition.get("description"):
            lines += [definition["description"], ""]
        lines += _table(definition)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
