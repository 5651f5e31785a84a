"""Checking one manifest's data against ``schemas/sless.schema.json``.

The schema is the single truth for the format. This module turns jsonschema's
errors into one-line problems that name the field and the reason in the
user's terms, and fills in the schema's defaults.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import jsonschema

from .. import paths
from .yamldoc import Path

__all__ = ["SchemaProblem", "apply_defaults", "check", "load_schema"]

_MAX_SHOWN = 80

SchemaProblem = tuple[Path, str]


@cache
def load_schema() -> dict[str, Any]:
    return json.loads(paths.schema_path().read_text())


@cache
def _validator() -> jsonschema.Draft202012Validator:
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


_TYPE_NAMES = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}
_SCHEMA_TYPES = {
    "string": "a string",
    "integer": "a whole number",
    "number": "a number",
    "boolean": "true or false",
    "object": "a mapping",
    "array": "a list",
}


def _type_reason(error: jsonschema.ValidationError) -> str:
    wanted = error.validator_value
    wanted = wanted if isinstance(wanted, list) else [wanted]
    expected = " or ".join(_SCHEMA_TYPES.get(w, w) for w in wanted)
    if error.instance is None:
        return f"has no value; expected {expected}"
    got = _TYPE_NAMES.get(type(error.instance), type(error.instance).__name__)
    reason = f"{_shown(error.instance)} is {got}; expected {expected}"
    numbers = {"integer", "number"} & set(wanted)  # a duration: quoting would not help
    if "string" in wanted and not numbers and isinstance(error.instance, bool | int | float):
        reason += " (quote it)"
    return reason


def _unknown_fields(error: jsonschema.ValidationError, path: Path) -> Iterator[SchemaProblem]:
    known = list(error.schema.get("properties", {}))
    patterns = [re.compile(p) for p in error.schema.get("patternProperties", {})]
    for key in error.instance:
        if key in known or any(p.search(key) for p in patterns):
            continue
        # 0.65, not 0.6: a hint must be likely (at 0.6, "colour" was taken for "rollout";
        # "retry" for "retries" is 0.67)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.65)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(known)}"
        yield (*path, key), f"unknown field{hint}"


def _problems(error: jsonschema.ValidationError) -> Iterator[SchemaProblem]:
    path: Path = tuple(error.absolute_path)
    kind = error.validator
    if "propertyNames" in error.relative_schema_path:
        # the instance is the key itself; point at it, not at its mapping
        hint = error.schema.get("x-pattern-hint") or error.message
        yield (*path, error.instance), f"name {_shown(error.instance)} {hint}"
    elif kind == "required":
        for key in error.validator_value:
            if key not in error.instance:
                yield (*path, key), "is required"
    elif kind == "additionalProperties" and error.validator_value is False:
        yield from _unknown_fields(error, path)
    elif kind == "pattern" and "x-pattern-hint" in error.schema:
        if error.instance != "":  # an empty value is reported once, by minLength
            yield path, f"{_shown(error.instance)} {error.schema['x-pattern-hint']}"
    elif kind == "type":
        if "enum" not in error.schema:  # the enum's message says more
            yield path, _type_reason(error)
    elif kind == "enum":
        allowed = ", ".join(_shown(v) for v in error.validator_value)
        yield path, f"{_shown(error.instance)} is not one of {allowed}"
    elif kind == "not":
        yield path, f"{_shown(error.instance)} is not allowed"
    elif kind == "minLength" and error.instance == "":
        yield path, "must not be empty"
    elif kind in ("maxLength", "minLength"):
        limit = "maximum" if kind == "maxLength" else "minimum"
        size = f"{len(error.instance)} characters; the {limit} is {error.validator_value}"
        yield path, f"{_shown(error.instance)} is {size}"
    elif kind == "minItems" and error.validator_value == 1:
        yield path, "must not be empty"
    elif kind in ("maxItems", "maxProperties"):
        yield path, f"has {len(error.instance)} entries; the maximum is {error.validator_value}"
    else:
        yield path, error.message


def check(data: Any) -> list[SchemaProblem]:
    """Every way ``data`` breaks the schema, as (path, reason), in document order."""
    found: list[SchemaProblem] = []
    for error in _validator().iter_errors(data):
        for problem in _problems(error):
            if problem not in found:
                found.append(problem)
    return found


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].removeprefix("#/$defs/")
        schema = {
            **load_schema()["$defs"][name],
            **{k: v for k, v in schema.items() if k != "$ref"},
        }
    return schema


def _branch(schema: dict[str, Any], instance: Any) -> dict[str, Any]:
    """The sub-schema that applies to ``instance``, following if/then/else."""
    schema = _resolve(schema)
    if "if" not in schema:
        return schema
    taken = "then" if jsonschema.Draft202012Validator(schema["if"]).is_valid(instance) else "else"
    return _branch(schema.get(taken, {}), instance) if taken in schema else schema


def apply_defaults(instance: Any, schema: dict[str, Any] | None = None) -> Any:
    """A copy of valid ``instance`` with every absent property that has a default filled in."""
    schema = _branch(load_schema() if schema is None else schema, instance)
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        out = {}
        for key, sub in props.items():
            sub = _resolve(sub)
            if key in instance:
                out[key] = apply_defaults(instance[key], sub)
            elif "default" in sub:
                out[key] = apply_defaults(json.loads(json.dumps(sub["default"])), sub)
        extra = schema.get("additionalProperties")
        for key, value in instance.items():
            if key not in props:
                out[key] = apply_defaults(value, extra) if isinstance(extra, dict) else value
        return out
    if schema.get("type") == "integer" and isinstance(instance, float):
        return int(instance)  # JSON Schema counts 256.0 as an integer; keep it one
    if isinstance(instance, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in instance]
    return instance
