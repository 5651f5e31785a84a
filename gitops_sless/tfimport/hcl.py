"""Reading a Terraform directory: every block and attribute with its file and line.

The parsing is python-hcl2's (its lark grammar, positions kept): this module only
walks the parse tree it returns. A file the parser refuses is a `Refusal` that names
the file, line and column the parser gave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hcl2
from lark import Token, Tree
from lark.exceptions import LarkError, UnexpectedInput

from .problems import Refusal, Where

__all__ = ["Attribute", "Block", "Module", "read_module"]


@dataclass(frozen=True)
class Attribute:
    """``name = expression``: the expression stays a parse tree, evaluated later."""

    name: str
    expr: Tree
    where: Where


@dataclass
class Block:
    """``type "label" ... { body }`` with its attributes and nested blocks."""

    type: str
    labels: tuple[str, ...]
    where: Where
    attributes: dict[str, Attribute] = field(default_factory=dict)
    blocks: list[Block] = field(default_factory=list)

    @property
    def address(self) -> str:
        """``sless_function.hello`` for a resource (as expressions name it), else ``module.x``."""
        parts = self.labels if self.type == "resource" else (self.type, *self.labels)
        return ".".join(parts)


@dataclass
class Module:
    """Everything read from one directory: the ``.tf`` blocks and the tfvars attributes."""

    root: Path
    blocks: list[Block]
    tfvars: list[Attribute]
    skipped: list[Where]  # files that look like Terraform but are not read (``*.tf.json``)
    unparsed: list[str]  # one line per file the parser refused (left out of blocks)


def read_module(root: Path) -> Module:
    """Parse every ``*.tf``, ``terraform.tfvars`` and ``*.auto.tfvars`` of ``root``.

    A file the parser refuses is left out and named in ``unparsed`` (file:line:column).
    """
    tf_files = sorted(root.glob("*.tf"))
    var_files = [root / "terraform.tfvars"] if (root / "terraform.tfvars").is_file() else []
    var_files += sorted(root.glob("*.auto.tfvars"))
    refusals: list[str] = []
    blocks: list[Block] = []
    tfvars: list[Attribute] = []
    for path in [*tf_files, *var_files]:
        try:
            body = _parse(path, root)
        except Refusal as exc:
            refusals.extend(exc.lines)
            continue
        file = path.relative_to(root).as_posix()
        if path in tf_files:
            blocks += [_block(node, file) for node in _children(body, "block")]
        else:
            tfvars += [_attribute(node, file) for node in _children(body, "attribute")]
    skipped = [Where(p.name, 1) for p in sorted(root.glob("*.tf.json"))]
    return Module(root, blocks, tfvars, skipped, refusals)


def _parse(path: Path, root: Path) -> Tree:
    file = path.relative_to(root).as_posix()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Refusal([f"{file}:1: cannot be read: {exc}"]) from exc
    try:
        tree = hcl2.parses_to_tree(text)
    except UnexpectedInput as exc:
        raise Refusal([f"{file}:{exc.line}:{exc.column}: not valid HCL: {_why(exc)}"]) from exc
    except LarkError as exc:  # the parser's own checks (heredocs, ...) after a match
        raise Refusal([f"{file}:1: not valid HCL: {str(exc).splitlines()[0]}"]) from exc
    return tree.children[0]  # start -> body


def _why(exc: UnexpectedInput) -> str:
    token = getattr(exc, "token", None)
    if token is not None:
        found = "the end of the file" if token.type == "$END" else repr(str(token).strip()[:30])
    else:
        found = repr(getattr(exc, "char", "?"))
    expected = sorted(getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())
    hint = f" (expected {', '.join(expected[:6])}{', ...' if len(expected) > 6 else ''})"
    return f"unexpected {found}" + (hint if expected else "")


def _children(tree: Tree, name: str) -> list[Tree]:
    return [c for c in tree.children if isinstance(c, Tree) and c.data == name]


def _label(node: Tree | Token) -> str:
    """A block type or label: an identifier, or a string of plain characters."""
    tokens = [t for t in (node.scan_values(lambda v: isinstance(v, Token))) if t.type != "DBLQUOTE"]
    return "".join(str(t) for t in tokens)


def _block(node: Tree, file: str) -> Block:
    head = [c for c in node.children if isinstance(c, Tree) and c.data != "body"]
    body = _children(node, "body")[0]
    block = Block(
        type=_label(head[0]),
        labels=tuple(_label(h) for h in head[1:] if h.data != "new_line_or_comment"),
        where=Where(file, node.meta.line),
    )
    for child in body.children:
        if isinstance(child, Tree) and child.data == "attribute":
            attribute = _attribute(child, file)
            block.attributes[attribute.name] = attribute
        elif isinstance(child, Tree) and child.data == "block":
            block.blocks.append(_block(child, file))
    return block


def _attribute(node: Tree, file: str) -> Attribute:
    name, _eq, expr = node.children
    return Attribute(name=_label(name), expr=expr, where=Where(file, node.meta.line))
