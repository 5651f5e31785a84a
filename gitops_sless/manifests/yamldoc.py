"""Reading one YAML document into plain JSON-like data, remembering where each value was.

PyYAML's own constructors lose line numbers, silently keep the last of two
duplicate keys, and expand aliases without limit. This module walks the
composed node graph itself so that every value knows its line, duplicate keys
are errors, and a document that expands past a node budget (an alias bomb) is
refused before it costs memory.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "Located", "YamlProblem", "field_path", "load"]

MAX_BYTES = 256 * 1024
MAX_NODES = 20_000
MAX_DEPTH = 64

Path = tuple[str | int, ...]

_STR = "tag:yaml.org,2002:str"
_MAP = "tag:yaml.org,2002:map"
_SEQ = "tag:yaml.org,2002:seq"
_MERGE = "tag:yaml.org,2002:merge"
_SCALARS = {
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    _STR,
}
_TIMESTAMP = "tag:yaml.org,2002:timestamp"


class YamlProblem(Exception):
    """A document cannot be read; ``path`` is where in the data, ``line`` is 1-based."""

    def __init__(self, line: int, path: Path, reason: str) -> None:
        super().__init__(reason)
        self.line = line
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Located:
    """Data of a document plus the line of every value, keyed by its path."""

    data: Any
    lines: dict[Path, int]

    def line_of(self, path: Path) -> int:
        """Line of ``path``, or of its nearest ancestor that has one."""
        path = tuple(path)
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path, 1)


def field_path(path: Path) -> str:
    """``("functions", 0, "env", "A")`` -> ``functions[0].env.A``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(root)"


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise YamlProblem(line, (), f"not valid UTF-8 (byte 0x{raw[exc.start]:02x})") from exc


def _syntax_problem(exc: yaml.MarkedYAMLError, text: str) -> YamlProblem:
    """Reported at the line the user must fix: where an unclosed quote or bracket began.

    PyYAML notices a missing quote or bracket where it runs into trouble, often
    lines later or at the end of the file; the line to edit is where it opened.
    """
    problem = exc.problem_mark
    opened = _opened(exc, text)
    if opened is not None:
        start, what = opened
        reason = f"YAML syntax error: {exc.problem}{_where(problem, start, text)}, {what}"
        return YamlProblem(start.line + 1, (), reason)
    last_line = text.count("\n") + 1
    context = exc.context_mark
    reason = f"YAML syntax error: {exc.problem or exc.context}"
    if problem is None or problem.line + 1 > last_line:
        # the parser ran off the end of the file: what it was reading is the news
        problem = context or problem
        if exc.context and context:
            reason += f" ({exc.context} that starts at line {context.line + 1})"
    return YamlProblem(problem.line + 1 if problem else 1, (), reason)


def _opened(exc: yaml.MarkedYAMLError, text: str) -> tuple[yaml.Mark, str] | None:
    """Where the quote, bracket or key the error is about began, and what it is."""
    context, problem, scanning = exc.context_mark, exc.problem_mark, exc.context or ""
    if context is not None and scanning.startswith("while scanning "):
        # a scanner error: its context is the token it could not finish
        what = scanning.removeprefix("while scanning ")
        what = _SCANNED.get(what, what)
        return context, f"in {what} that starts on this line"
    if problem is None:
        return None
    before = _tokens_before(text, problem.index)
    if before and _runs_on(before[-1]):
        scalar = before[-1]
        return scalar.start_mark, (
            f"after the quoted string that starts on this line and ends on line "
            f"{scalar.end_mark.line + 1} (is its closing quote missing?)"
        )
    flow = _open_flow(before)
    if flow is not None:
        kind = "[ list" if isinstance(flow, yaml.FlowSequenceStartToken) else "{ mapping"
        return flow.start_mark, f"in the {kind} that starts on this line"
    return None


_SCANNED = {
    "a quoted scalar": "the quoted string",
    "a double-quoted scalar": "the quoted string",
    "a single-quoted scalar": "the quoted string",
    "a simple key": "the key",
}


def _tokens_before(text: str, index: int) -> list[yaml.Token]:
    tokens: list[yaml.Token] = []
    with contextlib.suppress(yaml.YAMLError):
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if token.start_mark.index >= index:
                break
            tokens.append(token)
    return tokens


def _runs_on(token: yaml.Token) -> bool:
    """A quoted string over several lines: legal, but usually a quote left open."""
    return (
        isinstance(token, yaml.ScalarToken)
        and token.style in ("'", '"')
        and token.end_mark.line > token.start_mark.line
    )


def _open_flow(tokens: list[yaml.Token]) -> yaml.Token | None:
    """The innermost ``[`` or ``{`` not closed yet."""
    stack: list[yaml.Token] = []
    for token in tokens:
        if isinstance(token, (yaml.FlowSequenceStartToken, yaml.FlowMappingStartToken)):
            stack.append(token)
        elif isinstance(token, (yaml.FlowSequenceEndToken, yaml.FlowMappingEndToken)) and stack:
            stack.pop()
    return stack[-1] if stack else None


def _where(problem: yaml.Mark | None, start: yaml.Mark, text: str) -> str:
    if problem is None:
        return ""
    if problem.index >= len(text.rstrip()):
        return " at the end of the file"
    return f" at line {problem.line + 1}" if problem.line != start.line else ""


def _compose(text: str) -> yaml.Node | None:
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as exc:
        raise _syntax_problem(exc, text) from exc
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        reason = f"contains the character #x{exc.character:04x}, which YAML does not allow"
        raise YamlProblem(line, (), reason) from exc
    except yaml.YAMLError as exc:
        raise YamlProblem(1, (), f"YAML error: {' '.join(str(exc).split())}") from exc
    if len(nodes) > 1:
        raise YamlProblem(nodes[1].start_mark.line + 1, (), "more than one YAML document")
    return nodes[0] if nodes else None


def _shown_tag(tag: str) -> str:
    return "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml") else tag


class _Builder:
    def __init__(self) -> None:
        self.lines: dict[Path, int] = {}
        self.count = 0
        self._scalar = yaml.SafeLoader("")
        self._open: set[int] = set()  # collections being built: meeting one again is a cycle

    def build(self, node: yaml.Node, path: Path, line: int) -> Any:
        self.count += 1
        if self.count > MAX_NODES:
            raise YamlProblem(
                line, path, f"document expands to more than {MAX_NODES} values (alias bomb?)"
            )
        if len(path) > MAX_DEPTH:
            raise YamlProblem(line, path, f"nested deeper than {MAX_DEPTH} levels")
        self.lines.setdefault(path, line)
        if isinstance(node, yaml.ScalarNode):
            return self._scalar_value(node, path, line)
        if id(node) in self._open:
            raise YamlProblem(line, path, "recursive alias: the value contains itself")
        self._open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path)
            return self._sequence(node, path)
        finally:
            self._open.discard(id(node))

    def _scalar_value(self, node: yaml.ScalarNode, path: Path, line: int) -> Any:
        if node.tag == _TIMESTAMP:
            return node.value  # a date stays the text the user wrote
        if node.tag not in _SCALARS:
            raise YamlProblem(line, path, f"unsupported YAML tag {_shown_tag(node.tag)}")
        try:
            value = self._scalar.construct_object(node)
        except (ValueError, KeyError, yaml.YAMLError) as exc:
            reason = f"{node.value!r} is not a valid {_shown_tag(node.tag)}"
            raise YamlProblem(line, path, reason) from exc
        if isinstance(value, float) and not math.isfinite(value):
            raise YamlProblem(line, path, f"{node.value} is not a finite number")
        return value

    def _sequence(self, node: yaml.SequenceNode, path: Path) -> list[Any]:
        if node.tag != _SEQ:
            raise YamlProblem(
                node.start_mark.line + 1, path, f"unsupported YAML tag {_shown_tag(node.tag)}"
            )
        return [
            self.build(item, (*path, i), item.start_mark.line + 1)
            for i, item in enumerate(node.value)
        ]

    def _mapping(self, node: yaml.MappingNode, path: Path) -> dict[str, Any]:
        if node.tag != _MAP:
            raise YamlProblem(
                node.start_mark.line + 1, path, f"unsupported YAML tag {_shown_tag(node.tag)}"
            )
        out: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        merged: list[yaml.MappingNode] = []
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _MERGE:
                merged.extend(self._merge_sources(value_node, path, line))
                continue
            key = self._key(key_node, path, line)
            if key in first_line:
                raise YamlProblem(
                    line, (*path, key), f"duplicate key (first at line {first_line[key]})"
                )
            first_line[key] = line
            out[key] = self.build(value_node, (*path, key), line)
        for source in merged:  # explicit keys win over merged ones, as in YAML 1.1
            for key, value in self.build(source, path, source.start_mark.line + 1).items():
                out.setdefault(key, value)
        return out

    def _merge_sources(self, node: yaml.Node, path: Path, line: int) -> list[yaml.MappingNode]:
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        if not all(isinstance(s, yaml.MappingNode) for s in sources):
            raise YamlProblem(line, path, "a merge key (<<) needs a mapping or a list of mappings")
        return sources

    def _key(self, node: yaml.Node, path: Path, line: int) -> str:
        if not isinstance(node, yaml.ScalarNode):
            raise YamlProblem(line, path, "a mapping or list cannot be a key; keys are strings")
        if node.tag != _STR:
            raise YamlProblem(line, path, f"key {node.value} is not a string; quote it")
        return node.value


def load(raw: bytes) -> Located:
    """Parse one YAML document of at most ``MAX_BYTES`` into JSON-like data with lines."""
    if len(raw) > MAX_BYTES:
        raise YamlProblem(1, (), f"file is {len(raw)} bytes; the limit is {MAX_BYTES}")
    node = _compose(_decode(raw))
    if node is None:
        return Located(None, {(): 1})
    builder = _Builder()
    data = builder.build(node, (), node.start_mark.line + 1)
    return Located(data, builder.lines)
