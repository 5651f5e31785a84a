"""Plain YAML templates with ``${name}`` placeholders, filled in the parsed tree.

A template is parsed as YAML once; placeholders are then replaced in the
parsed data, never in text, so no value can inject structure. A placeholder
that is a whole scalar takes the value as it is (an int stays an int, a
mapping stays a mapping, ``OMIT`` removes the key or item); a placeholder
inside a longer string takes the value's text. Values are inserted once and
never scanned again, so a value containing ``${x}`` stays literal.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from .. import paths
from ..errors import TemplateError

__all__ = ["OMIT", "fill", "render"]

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Omit:
    """The one marker that removes a key or item; copying keeps it the same object."""

    def __repr__(self) -> str:
        return "OMIT"

    def __deepcopy__(self, memo: dict[int, Any]) -> _Omit:
        return self


OMIT: Any = _Omit()


@cache
def _parsed(folder: Path, name: str) -> Any:
    path = folder / f"{name}.yaml"
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TemplateError(f"{path}: cannot be read as YAML: {exc}") from exc


class _Filler:
    def __init__(self, name: str, values: dict[str, Any]) -> None:
        self.name = name
        self.values = values

    def value(self, key: str) -> Any:
        if key not in self.values:
            raise TemplateError(f"templates/{self.name}.yaml: placeholder ${{{key}}} has no value")
        return self.values[key]

    def text(self, match: re.Match[str]) -> str:
        value = self.value(match.group(1))
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise TemplateError(
                f"templates/{self.name}.yaml: ${{{match.group(1)}}} is inside a string "
                f"but its value is {type(value).__name__}"
            )
        return str(value)

    def fill(self, node: Any) -> Any:
        if isinstance(node, dict):
            filled = {k: self.fill(v) for k, v in node.items()}
            return {k: v for k, v in filled.items() if v is not OMIT}
        if isinstance(node, list):
            return [item for item in map(self.fill, node) if item is not OMIT]
        if isinstance(node, str):
            whole = _PLACEHOLDER.fullmatch(node)
            if whole:
                return copy.deepcopy(self.value(whole.group(1)))
            return _PLACEHOLDER.sub(self.text, node)
        return node


def fill(template: Any, values: dict[str, Any], name: str = "<inline>") -> Any:
    """``template`` (parsed YAML) with every placeholder replaced from ``values``."""
    return _Filler(name, values).fill(template)


def render(name: str, values: dict[str, Any], folder: Path | None = None) -> Any:
    """The template ``templates/<name>.yaml`` filled with ``values``."""
    return fill(_parsed(folder or paths.templates_dir(), name), values, name)
