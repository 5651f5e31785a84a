"""What stops an import before anything is written: ``for_each`` and dangling references.

Terraform itself refuses a reference to a resource nobody declares, so such a
directory was never applied as it is; ``for_each`` makes one block many objects
whose names the import cannot know. Unparseable files are refused by `hcl.read_module`.
"""

from __future__ import annotations

from collections.abc import Iterator

from lark import Tree

from .evaluate import NON_RESOURCE_ROOTS, traversal
from .hcl import Block, Module
from .problems import Where

__all__ = ["refusals"]

# attributes whose references name providers, not resources
_PROVIDER_ATTRIBUTES = ("provider", "providers")
# expressions that bring their own names into scope ([for s in ... : s.x])
_SCOPES = ("for_tuple_expr", "for_object_expr")


def refusals(module: Module) -> list[str]:
    """One line per reason, in file and line order."""
    declared = {b.address for b in module.blocks if b.type in ("resource", "data")}
    found: list[tuple[Where, str]] = []
    for block in module.blocks:
        if block.type in ("resource", "module") and "for_each" in block.attributes:
            where = block.attributes["for_each"].where
            found.append(
                (
                    where,
                    f"{block.address}: for_each makes one block many objects "
                    "whose names the import cannot know; write one block per object",
                )
            )
        for where, root, path in _references(block):
            address = f"{root}.{path[0]}" if path and isinstance(path[0], str) else root
            if root in NON_RESOURCE_ROOTS or address in declared:
                continue
            found.append((where, f"{block.address}: refers to {address}, which no block declares"))
    return [f"{where}: {text}" for where, text in sorted(set(found))]


def _references(block: Block) -> Iterator[tuple[Where, str, list[str | int]]]:
    for attribute in block.attributes.values():
        if attribute.name in _PROVIDER_ATTRIBUTES:
            continue
        for node, line in _traversals(attribute.expr, attribute.where.line):
            found = traversal(node)
            if found and found[1]:
                yield Where(attribute.where.file, line), found[0], found[1]
    for nested in block.blocks:
        yield from _references(nested)


def _traversals(node: Tree, line: int) -> Iterator[tuple[Tree, int]]:
    line = getattr(node.meta, "line", line)
    if node.data in _SCOPES:
        return
    if node.data in ("get_attr_expr_term", "index_expr_term"):
        yield node, line
        return
    if node.data == "object_elem":
        # an object key that is a bare name is a key, not a reference
        node = Tree("values", node.children[1:], node.meta)
    for child in node.children:
        if isinstance(child, Tree):
            yield from _traversals(child, line)
