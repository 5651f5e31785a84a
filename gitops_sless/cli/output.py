"""How the command line writes to a terminal or a pipe: colours, tables, progress."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["PHASE_STYLE", "Paint", "colour", "progress", "short", "styled", "table", "write"]

Paint = Callable[[str, str], str]

PHASE_STYLE = {
    "Ready": "green",
    "Idle": "dim",
    "Disabled": "dim",
    "Pending": "yellow",
    "Building": "yellow",
    "Running": "yellow",
    "Failed": "red",
    "RolledBack": "red",
    "Invalid": "red",
    "Degraded": "red",
    "Progressing": "yellow",
    "Succeeded": "green",
    "Skipped": "dim",
}


def colour(stream: TextIO) -> Paint:
    """``paint(text, style)``: ANSI colours on a terminal (not with NO_COLOR), else plain."""
    on = stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
    codes = {"green": "32", "red": "31", "yellow": "33", "dim": "2", "bold": "1", "cyan": "36"}

    def paint(text: str, style: str) -> str:
        return f"\033[{codes[style]}m{text}\033[0m" if on and style in codes else text

    return paint


def styled(phase: str, paint: Paint) -> str:
    """A phase or result in its colour."""
    return paint(phase, PHASE_STYLE.get(phase, ""))


def short(revision: str | None) -> str:
    return revision[:12] if revision else "-"


def table(rows: list[list[str]], styles: list[list[str]], paint: Paint) -> str:
    """Columns padded to their widest cell; the last one is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row, style in zip(rows, styles, strict=True):
        cells = [
            paint(cell.ljust(width) if i < len(row) - 1 else cell, style[i])
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def write(text: str) -> None:
    """Text to stdout as UTF-8 whatever the locale (a log may hold any character)."""
    sys.stdout.buffer.write(text.encode("utf-8", "replace"))
    sys.stdout.buffer.flush()


@contextlib.contextmanager
def progress(what: str) -> Iterator[None]:
    """A line that counts seconds on a terminal's stderr while the block runs."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while True:
            sys.stderr.write(f"\r{what}… {time.monotonic() - started:.0f}s")
            sys.stderr.flush()
            if done.wait(0.2):
                return

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
