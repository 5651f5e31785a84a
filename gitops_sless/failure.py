"""What went wrong, from what a runtime process printed before it failed.

A process that fails prints a Python traceback, a Node stack trace or a few
lines of its own. The user needs the line that names the problem (the
exception) and where it is (``handler.py:5``, plus the source line of a syntax
error), not the last few hundred characters of the stream, which usually end
in the runtime's own frames. :func:`cause` finds that; for any other output it
keeps the last lines, whole.

Paths inside the function folder are shown relative to it: that folder is a
copy under the state directory, and the user knows the files by their names
in the repository.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["cause"]

SCAN_CHARS = 64_000  # the cause is at the end; a handler may print megabytes before it
MAX_LINE = 300
MAX_LINES = 3
DEPENDENCY_DIRS = (".sless-deps", "node_modules")  # code the user did not write

_TRACEBACK = "Traceback (most recent call last):"
_PY_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?$')
_NODE_FRAME = re.compile(r"^ {4}at (?:.* \()?(?P<file>[^()\s]+?):(?P<line>\d+):\d+\)?$")
_NODE_ERROR = re.compile(r"^(?:Uncaught )?[A-Za-z_$][\w$.]*(?: \[\w+\])?: \S|^[A-Z][\w$]*Error$")
_NODE_HEADER = re.compile(r"^(?P<file>\S.*):(?P<line>\d+)$")
_CARET = re.compile(r"^\s*[\^~]+\s*$")
_NODE_ERROR_ABOVE = 12


@dataclass(frozen=True)
class _Found:
    error: list[str]  # the exception line, and the lines of a message that goes on
    where: tuple[str, str] | None = None  # (file, line)
    source: str | None = None  # the offending line of code


def cause(output: str, folder: Path | str | None = None) -> str:
    """The few lines of ``output`` that say what went wrong ("" if it printed nothing).

    ``folder`` is the function folder the process ran from: paths below it are
    shown relative to it, and its own files (not its dependencies) are where
    a runtime error is located.
    """
    lines = _lines(output)
    found = _python(lines, folder) or _node(lines, folder)
    return _relative(_fallback(lines) if found is None else _render(found), folder)


def installer_cause(output: str) -> str | None:
    """The line in which pip or npm says why it failed (``No matching distribution found
    for x``, ``npm error 404 Not Found ...``), or None when it said nothing such."""
    lines = _lines(output)
    pip = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR: ")]
    if pip:
        return _bounded(pip[-1])  # pip says the conclusion last
    npm = [
        line
        for line in lines
        if line.startswith(("npm error", "npm ERR!")) and "complete log" not in line
    ]
    # npm says the code first ("npm error code E404"), then what happened
    told = [line for line in npm if line.split()[2:3] not in ([], ["code"])]
    return _bounded((told or npm)[0]) if npm else None


def _lines(output: str) -> list[str]:
    if len(output) > SCAN_CHARS:
        # the first line is cut: drop it rather than show half of it (unless it is all there is)
        cut = output[-SCAN_CHARS:]
        _, newline, rest = cut.partition("\n")
        output = rest if newline else cut
    return [line.rstrip() for line in output.splitlines()]


def _render(found: _Found) -> str:
    first = _bounded(found.error[0])
    if found.where:
        first = f"{found.where[0]}:{found.where[1]}: {first}"
    shown = [first, *(_bounded(line) for line in found.error[1:])]
    if found.source:
        shown.insert(1, "    " + _bounded(found.source.strip()))
    return "\n".join(shown[:MAX_LINES])


def _fallback(lines: list[str]) -> str:
    kept = [line.strip() for line in lines if line.strip()][-MAX_LINES:]
    return "\n".join(_bounded(line) for line in kept)


def _bounded(line: str) -> str:
    """``line``, shortened at a word boundary when it is long."""
    if len(line) <= MAX_LINE:
        return line
    cut = line[:MAX_LINE]
    space = cut.rfind(" ")
    if space > MAX_LINE // 2:
        cut = cut[:space]
    return cut.rstrip() + " …"


def _prefixes(folder: Path | str | None) -> list[str]:
    if folder is None:
        return []
    # Node reports real paths (symlinks resolved), Python the path it was given
    found = {os.path.abspath(folder), os.path.realpath(folder)}
    return sorted((p.rstrip("/") + "/" for p in found), key=len, reverse=True)


def _relative(text: str, folder: Path | str | None) -> str:
    for prefix in _prefixes(folder):
        text = text.replace("file://" + prefix, "").replace(prefix, "")
    return text


def _own(file: str, folder: Path | str | None) -> bool:
    """A file the user wrote: in the function folder, not among its dependencies."""
    file = file.removeprefix("file://")
    for prefix in _prefixes(folder):
        if file.startswith(prefix):
            rel = file[len(prefix) :]
            return not rel.startswith(tuple(d + "/" for d in DEPENDENCY_DIRS))
    return False


# --- Python -------------------------------------------------------------------------------


def _python(lines: list[str], folder: Path | str | None) -> _Found | None:
    starts = [i for i, line in enumerate(lines) if line == _TRACEBACK]
    if not starts:
        return None
    i = starts[-1] + 1  # the last traceback is the exception that was raised
    frames: list[tuple[re.Match[str], int]] = []
    while i < len(lines) and lines[i].startswith(" "):
        match = _PY_FRAME.match(lines[i])
        if match:
            frames.append((match, i))
        i += 1
    error = _message(lines, i)
    if not error:
        return None
    if frames and frames[-1][0]["func"] is None:
        # a syntax error: its last "frame" is the file and line that do not parse
        match, at = frames[-1]
        return _Found(error, (match["file"], match["line"]), _python_source(lines, at))
    own = [m for m, _ in frames if _own(m["file"], folder)]
    return _Found(error, (own[-1]["file"], own[-1]["line"]) if own else None)


def _message(lines: list[str], start: int) -> list[str]:
    """The exception line and the lines of its message, up to a blank line."""
    message = []
    for line in lines[start : start + MAX_LINES]:
        if not line.strip():
            break
        message.append(line)
    return message


def _python_source(lines: list[str], frame: int) -> str | None:
    for line in lines[frame + 1 : frame + 3]:
        if line.startswith("    ") and not _CARET.match(line):
            return line
    return None


# --- Node ---------------------------------------------------------------------------------


def _node(lines: list[str], folder: Path | str | None) -> _Found | None:
    at = _node_error_line(lines)
    if at is None:
        return None
    error = [lines[at]]
    for line in lines[at + 1 : at + MAX_LINES]:
        if not line.strip() or line.startswith("    at ") or line == "Require stack:":
            break
        error.append(line)
    header = _node_header(lines, at)
    if header is not None:
        match, source = header
        return _Found(error, (match["file"].removeprefix("file://"), match["line"]), source)
    own = [m for m in map(_NODE_FRAME.match, lines[at + 1 :]) if m and _own(m["file"], folder)]
    return _Found(error, (own[0]["file"].removeprefix("file://"), own[0]["line"]) if own else None)


def _node_error_line(lines: list[str]) -> int | None:
    """The ``Error: ...`` line just above the last stack trace."""
    frames = [i for i, line in enumerate(lines) if line.startswith("    at ")]
    if not frames:
        return None
    end = frames[-1]
    while end > 0 and lines[end - 1].startswith("    at "):
        end -= 1
    # a message may go on over a few lines, and a missing module lists who required it
    for i in range(end - 1, max(-1, end - 1 - _NODE_ERROR_ABOVE), -1):
        if _NODE_ERROR.match(lines[i]):
            return i
    return None


def _node_header(lines: list[str], at: int) -> tuple[re.Match[str], str] | None:
    """Node's ``file:line`` / source line / caret above a syntax (or uncaught) error."""
    i = at - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i < 2 or not _CARET.match(lines[i]):
        return None
    header = _NODE_HEADER.match(lines[i - 2])
    return (header, lines[i - 1]) if header else None
