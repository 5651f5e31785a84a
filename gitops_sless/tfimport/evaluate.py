"""Evaluating the few HCL expressions an import needs, and refusing the rest.

Supported: literals, tuples and objects, strings with ``${...}`` interpolation,
``var.*`` (defaults, ``terraform.tfvars``, ``*.auto.tfvars``), ``path.module``,
``jsonencode(...)``, and references to attributes of ``sless_function``,
``sless_trigger`` and ``sless_job`` resources (``sless_job.X.message`` becomes a
`JobResult`). Anything else raises `NotConvertible` naming the construct and why.

A value remembers which sensitive variables it was made from, so a secret stays
a secret through interpolation and ``jsonencode``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lark import Token, Tree

from .hcl import Attribute, Module
from .problems import NotConvertible, Where

__all__ = ["SLESS_TYPES", "Evaluator", "JobResult", "Value", "Variable", "traversal"]

SLESS_TYPES = ("sless_function", "sless_trigger", "sless_job")
# roots of references that name something other than a resource
NON_RESOURCE_ROOTS = {
    "var": "",
    "path": "",
    "local": "local values are not evaluated (write the value in place)",
    "module": "modules are not converted",
    "data": "data sources are not read",
    "each": "for_each is not converted",
    "count": "count is not converted",
    "self": "self references are not converted",
    "terraform": "terraform.* values are not converted",
}
_UNSUPPORTED = {
    "binary_op": "an arithmetic or logical operator",
    "unary_op": "an arithmetic or logical operator",
    "conditional": "a conditional (a ? b : c)",
    "for_tuple_expr": "a for expression",
    "for_object_expr": "a for expression",
    "attr_splat_expr_term": "a splat expression",
    "full_splat_expr_term": "a splat expression",
    "template_string": "a template directive",
    "heredoc_template": "a heredoc",
    "heredoc_template_trim": "a heredoc",
}
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}


@dataclass(frozen=True)
class JobResult:
    """``sless_job.X.message``: the job's JSON result, ``{job: NAME}`` in sless.yaml."""

    job: str  # the resource address, sless_job.X


@dataclass(frozen=True)
class Value:
    data: Any
    sensitive: frozenset[str] = frozenset()  # the sensitive variables it was made from


@dataclass(frozen=True)
class Variable:
    name: str
    value: Any
    sensitive: bool
    where: Where  # where its value comes from: a tfvars line or the default's
    has_value: bool = True


def traversal(node: Tree) -> tuple[str, list[str | int]] | None:
    """``a.b["c"][0]`` as (``a``, [``b``, ``c``, 0]); None for anything else."""
    node = _inner(node)
    if node.data == "identifier":
        return str(node.children[0]), []
    if node.data not in ("get_attr_expr_term", "index_expr_term"):
        return None
    head = traversal(node.children[0])
    if head is None:
        return None
    step = node.children[1]
    if step.data == "get_attr":
        return head[0], [*head[1], _token_text(step.children[1])]
    if step.data == "short_index":
        return head[0], [*head[1], int(str(step.children[1]))]
    key = _inner(_expressions(step)[0])
    if key.data == "int_lit":
        return head[0], [*head[1], int(str(key.children[0]))]
    if key.data == "string" and all(isinstance(p.children[0], Token) for p in key.children[1:-1]):
        return head[0], [*head[1], "".join(_chars(p.children[0]) for p in key.children[1:-1])]
    return None


def _token_text(node: Tree | Token) -> str:
    return str(node) if isinstance(node, Token) else str(node.children[0])


def _expressions(node: Tree) -> list[Tree]:
    return [c for c in node.children if isinstance(c, Tree) and c.data != "new_line_or_comment"]


def _inner(node: Tree) -> Tree:
    """Through ``expr_term`` and parentheses to the node that says what it is."""
    while node.data == "expr_term":
        node = _expressions(node)[0]
    return node


def _chars(token: Token) -> str:
    text = str(token)
    if token.type == "ESCAPED_INTERPOLATION":
        return text[1:]  # $${x} is the literal ${x}
    if token.type == "ESCAPED_DIRECTIVE":
        return text[1:]
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            marker = text[i + 1]
            if marker in _ESCAPES:
                out.append(_ESCAPES[marker])
                i += 2
                continue
            if marker in "uU":
                width = 4 if marker == "u" else 8
                out.append(chr(int(text[i + 2 : i + 2 + width], 16)))
                i += 2 + width
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _string(data: Any, where: Where) -> str:
    """Interpolation turns numbers and booleans into strings, as Terraform does."""
    if isinstance(data, bool):
        return "true" if data else "false"
    if isinstance(data, int | float | str):
        return str(data)
    if isinstance(data, JobResult):
        raise NotConvertible(
            where,
            f"{data.job}.message inside a string",
            "only a whole env value can take a job's result ({job: NAME})",
        )
    raise NotConvertible(where, "a list or object inside a string", "Terraform refuses it too")


class Evaluator:
    """Evaluates attributes of one module; resources are looked up by address."""

    def __init__(self, module: Module, variables: dict[str, Variable]) -> None:
        self.root = module.root
        self.variables = variables
        self.resources = {b.address: b for b in module.blocks if b.type == "resource"}
        self._evaluating: set[tuple[str, str]] = set()

    def attribute(self, attribute: Attribute) -> Value:
        sensitive: set[str] = set()
        data = self._eval(attribute.expr, attribute.where, sensitive)
        return Value(data, frozenset(sensitive))

    def entries(self, attribute: Attribute) -> list[tuple[str, Where, Value | NotConvertible]]:
        """An object attribute (``env_vars``) entry by entry: one bad entry spoils only itself."""
        node = _inner(attribute.expr)
        if node.data != "object":
            try:
                data = self.attribute(attribute)
            except NotConvertible as exc:
                return [("", attribute.where, exc)]
            if not isinstance(data.data, dict):
                why = "expected a map"
                return [("", attribute.where, NotConvertible(attribute.where, attribute.name, why))]
            return [(k, attribute.where, Value(v, data.sensitive)) for k, v in data.data.items()]
        out: list[tuple[str, Where, Value | NotConvertible]] = []
        for elem in (c for c in node.children if isinstance(c, Tree) and c.data == "object_elem"):
            where = Where(attribute.where.file, elem.meta.line)
            sensitive: set[str] = set()
            try:
                key = self._key(elem.children[0], where, sensitive)
                data = self._eval(elem.children[-1], where, sensitive)
            except NotConvertible as exc:
                out.append((_key_text(elem), where, exc))
                continue
            out.append((key, where, Value(data, frozenset(sensitive))))
        return out

    def _eval(self, node: Tree, where: Where, sensitive: set[str]) -> Any:
        node = _inner(node)
        where = Where(where.file, getattr(node.meta, "line", where.line))
        kind = node.data
        if kind in _UNSUPPORTED:
            raise NotConvertible(where, _UNSUPPORTED[kind], "not evaluated by the import")
        if kind == "string":
            return self._template(node, where, sensitive)
        if kind == "int_lit":
            return int(str(node.children[0]))
        if kind == "float_lit":
            return float(str(node.children[0]))
        if kind == "literal_value":
            return {"true": True, "false": False, "null": None}[str(node.children[0])]
        if kind == "tuple":
            return [self._eval(e, where, sensitive) for e in _expressions(node)]
        if kind == "object":
            return self._object(node, where, sensitive)
        if kind == "function_call":
            return self._call(node, where, sensitive)
        path = traversal(node)
        if path is None:
            raise NotConvertible(where, f"the expression {kind}", "not evaluated by the import")
        return self._reference(path[0], path[1], where, sensitive)

    def _template(self, node: Tree, where: Where, sensitive: set[str]) -> Any:
        parts = [c.children[0] for c in node.children if isinstance(c, Tree)]
        if len(parts) == 1 and isinstance(parts[0], Tree) and parts[0].data == "interpolation":
            # "${x}" alone is x itself, of any type: a job result stays one
            return self._eval(_expressions(parts[0])[0], where, sensitive)
        out = []
        for part in parts:
            if isinstance(part, Token):
                out.append(_chars(part))
            elif part.data == "interpolation":
                out.append(_string(self._eval(_expressions(part)[0], where, sensitive), where))
            else:
                raise NotConvertible(where, "a template directive (%{...})", "not evaluated")
        return "".join(out)

    def _object(self, node: Tree, where: Where, sensitive: set[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for elem in (c for c in node.children if isinstance(c, Tree) and c.data == "object_elem"):
            key = self._key(elem.children[0], where, sensitive)
            out[key] = self._eval(elem.children[-1], where, sensitive)
        return out

    def _key(self, key_node: Tree, where: Where, sensitive: set[str]) -> str:
        key_inner = key_node.children[0]
        if isinstance(key_inner, Tree) and key_inner.data == "keyword":
            return str(key_inner.children[0])
        if _inner(key_inner).data == "identifier":
            return str(_inner(key_inner).children[0])  # {a = 1}: a is a name, not a reference
        return _string(self._eval(key_inner, where, sensitive), where)

    def _call(self, node: Tree, where: Where, sensitive: set[str]) -> Any:
        name = _token_text(node.children[0])
        args_node = next(
            (c for c in node.children if isinstance(c, Tree) and c.data == "arguments"), None
        )
        args = _expressions(args_node) if args_node is not None else []
        if name != "jsonencode":
            raise NotConvertible(where, f"the function {name}()", "only jsonencode() is evaluated")
        if len(args) != 1:
            raise NotConvertible(where, "jsonencode()", "takes exactly one argument")
        data = self._eval(args[0], where, sensitive)
        if _has_job_result(data):
            raise NotConvertible(
                where,
                "a job's result inside jsonencode()",
                "a job result is only a whole env value",
            )
        # Terraform's jsonencode sorts object keys and adds no spaces
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def _reference(
        self, root: str, path: list[str | int], where: Where, sensitive: set[str]
    ) -> Any:
        text = ".".join([root, *map(str, path)])
        if root == "var":
            return self._variable(path, where, sensitive)
        if root == "path":
            if path == ["module"] or path == ["root"]:
                return str(self.root)
            raise NotConvertible(where, text, "only path.module and path.root are evaluated")
        if root in NON_RESOURCE_ROOTS:
            raise NotConvertible(where, text, NON_RESOURCE_ROOTS[root])
        if not path or not isinstance(path[0], str):
            raise NotConvertible(where, text, "not a reference the import knows")
        address = f"{root}.{path[0]}"
        if address not in self.resources:
            raise NotConvertible(where, text, f"no resource {address} is declared")
        if root not in SLESS_TYPES:
            raise NotConvertible(
                where, text, f"{root} is not a sless resource and is not converted"
            )
        return self._resource_attribute(address, path[1:], where, sensitive)

    def _variable(self, path: list[str | int], where: Where, sensitive: set[str]) -> Any:
        name = str(path[0]) if path else ""
        variable = self.variables.get(name)
        if variable is None:
            raise NotConvertible(where, f"var.{name}", "no such variable is declared")
        if not variable.has_value:
            raise NotConvertible(
                where, f"var.{name}", "has no default and no value in terraform.tfvars"
            )
        if variable.sensitive:
            sensitive.add(name)
        return _index(variable.value, path[1:], where, f"var.{name}")

    def _resource_attribute(
        self, address: str, path: list[str | int], where: Where, sensitive: set[str]
    ) -> Any:
        if not path:
            raise NotConvertible(where, address, "a whole resource is not a value here")
        name = str(path[0])
        if address.startswith("sless_job.") and name == "message":
            if len(path) > 1:
                raise NotConvertible(
                    where, f"{address}.message{path[1:]}", "only the whole result can be passed"
                )
            return JobResult(address)
        block = self.resources[address]
        attribute = block.attributes.get(name)
        if attribute is None:
            raise NotConvertible(
                where, f"{address}.{name}", "has no counterpart in a functions repository"
            )
        if (address, name) in self._evaluating:
            raise NotConvertible(where, f"{address}.{name}", "refers to itself")
        self._evaluating.add((address, name))
        try:
            data = self._eval(attribute.expr, attribute.where, sensitive)
        finally:
            self._evaluating.discard((address, name))
        return _index(data, path[1:], where, f"{address}.{name}")


def _index(data: Any, path: list[str | int], where: Where, text: str) -> Any:
    for step in path:
        try:
            data = data[step]
        except (KeyError, IndexError, TypeError):
            raise NotConvertible(where, f"{text}.{step}", "has no such element") from None
        text = f"{text}.{step}"
    return data


def _key_text(elem: Tree) -> str:
    tokens = elem.children[0].scan_values(lambda v: isinstance(v, Token))
    return "".join(str(t) for t in tokens if t.type != "DBLQUOTE")


def _has_job_result(data: Any) -> bool:
    if isinstance(data, JobResult):
        return True
    if isinstance(data, dict):
        return any(_has_job_result(v) for v in data.values())
    if isinstance(data, list):
        return any(_has_job_result(v) for v in data)
    return False
