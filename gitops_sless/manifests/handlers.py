"""Static checks of a handler's code: it parses, and it defines the entrypoint's function.

Nothing here runs the code. Python is parsed with ``ast`` in process; Node with
``node --check`` (V8's parser, reading the source from stdin, never the file's
imports) where a ``node`` is on PATH: without one (the reconciler's image) the
syntax check is left to the replica's start, which reports the same error.

Both checks only ever refuse what the runtime would refuse too. A module whose names
cannot be known without running it (``from x import *``, a module ``__getattr__``,
``globals()`` written to; a Node file that requires or re-exports another) passes.
"""

from __future__ import annotations

import ast
import json
import os
import posixpath
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["CodeProblem", "check", "loads_as_esm"]

NODE_CHECK_TIMEOUT_SEC = 10.0
# the first line of node --check's report on stdin: "[stdin]:LINE"
_NODE_WHERE = re.compile(rb"^\[stdin\]:(\d+)", re.MULTILINE)
_NODE_ERROR = re.compile(rb"^(\w*Error: .*)$", re.MULTILINE)
_MODULE_SYNTAX = re.compile(rb"^\s*(import|export)\b", re.MULTILINE)
# what makes a Node file's exports unknowable without running it
_NODE_ELSEWHERE = re.compile(
    r"\brequire\s*\(|\bimport\s*\(|\bexport\s*\*|\bexport\s*\{[^}]*\}\s*from\b"
)


@dataclass(frozen=True)
class CodeProblem:
    """What is wrong; ``line`` is in the handler file when ``in_code``, else the problem
    is the entrypoint's (the manifest names a function the file does not define)."""

    reason: str
    line: int = 1
    in_code: bool = True


def check(interpreter: str, source: bytes, function: str, esm: bool = False) -> CodeProblem | None:
    """The first thing wrong with a handler file of a runtime run by ``interpreter``
    (``python3`` or ``node``; other runtimes are not checked), or None."""
    if interpreter.startswith("python"):
        return _python(source, function)
    if interpreter == "node":
        return _node(source, function, esm)
    return None


# --- Python ------------------------------------------------------------------


def _python(source: bytes, function: str) -> CodeProblem | None:
    try:
        tree = ast.parse(source, feature_version=(3, 11))
    except SyntaxError as exc:
        return CodeProblem(f"SyntaxError: {exc.msg}", exc.lineno or 1)
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        return CodeProblem(f"cannot be parsed: {exc}")
    names = _module_names(tree)
    if names is None or function in names or _declared_global(tree, function):
        return None
    defined = sorted(n for n in names if not n.startswith("_"))
    listed = ", ".join(defined[:8]) + (", ..." if len(defined) > 8 else "")
    return CodeProblem(
        f"defines no {function!r} at module level"
        + (f" (it defines {listed})" if defined else " (it defines nothing public)"),
        in_code=False,
    )


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _module_names(tree: ast.Module) -> set[str] | None:
    """Every name the module binds at its top level, in any branch (a def under ``if``
    or ``try`` counts); None when they cannot be known statically."""
    names: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, _SCOPES):
            names.add(getattr(node, "name", ""))
            if isinstance(node, ast.Lambda):
                continue
            # decorators and defaults run at module level; the body does not
            todo.extend(getattr(node, "decorator_list", ()))
            continue
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return None
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.MatchAs | ast.MatchStar) and node.name:
            names.add(node.name)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("globals", "exec", "setattr", "vars")
        ):
            return None
        if isinstance(node, _COMPREHENSIONS):
            continue  # their variables are their own (a walrus inside is too rare to chase)
        todo.extend(ast.iter_child_nodes(node))
    if "__getattr__" in names:
        return None
    return names


def _declared_global(tree: ast.Module, function: str) -> bool:
    """Whether some function body binds ``function`` at module level (``global main``)."""
    return any(isinstance(n, ast.Global) and function in n.names for n in ast.walk(tree))


# --- Node --------------------------------------------------------------------


def _node(source: bytes, function: str, esm: bool) -> CodeProblem | None:
    problem = _node_syntax(source, esm)
    if problem is not None:
        return problem
    text = source.decode("utf-8", "replace")
    named = re.search(rf"(?<![\w$]){re.escape(function)}(?![\w$])", text)
    if named or _NODE_ELSEWHERE.search(text):
        return None
    return CodeProblem(f"does not export {function!r} (the name is nowhere in it)", in_code=False)


def _node_syntax(source: bytes, esm: bool) -> CodeProblem | None:
    """As Node 20 loads a ``.js`` file: an ES module when package.json says so; else
    CommonJS, and an ES module after all when only that parses (its module syntax
    detection), whose error is the one shown for a file written with import/export."""
    node = shutil.which("node")
    if node is None:
        return None
    if esm:
        return _node_check(node, source, "module")
    problem = _node_check(node, source, "commonjs")
    if problem is None:
        return None
    as_module = _node_check(node, source, "module")
    if as_module is None:
        return None
    return as_module if _MODULE_SYNTAX.search(source) else problem


def _node_check(node: str, source: bytes, kind: str) -> CodeProblem | None:
    try:
        done = subprocess.run(
            [node, "--check", f"--input-type={kind}", "-"],
            input=source,
            capture_output=True,
            timeout=NODE_CHECK_TIMEOUT_SEC,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},  # no NODE_OPTIONS
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None  # left to the replica's start, which says the same
    if done.returncode == 0:
        return None
    where = _NODE_WHERE.search(done.stderr)
    error = _NODE_ERROR.search(done.stderr)
    if where is None or error is None:
        return None  # not a syntax report: node itself failed
    return CodeProblem(error.group(1).decode("utf-8", "replace"), int(where.group(1)))


def loads_as_esm(rel: str, files: Mapping[str, str], read: Callable[[str], bytes]) -> bool:
    """Whether Node loads ``rel`` (a path in the function's folder, whose ``files`` are
    given) as an ES module: the nearest package.json at or above it, inside the folder,
    says ``"type": "module"``, as ``require`` decides."""
    folder = posixpath.dirname(rel)
    while True:
        package = posixpath.join(folder, "package.json")
        if files.get(package) == "blob":
            try:
                data = json.loads(read(package))
            except ValueError:
                return False
            return isinstance(data, dict) and data.get("type") == "module"
        if not folder:
            return False
        folder = posixpath.dirname(folder)
