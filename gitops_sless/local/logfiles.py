"""Bounded output: log files that never pass their cap, and bounded reads of a child's pipes.

What a function prints is the function author's to choose, so nothing it
prints may grow without bound on the state disk or in the reconciler's
memory:

- :func:`append` writes to a log file that never passes ``MAX_LOG_BYTES``
  (8 MiB). A write that would take it past the cap rotates it first: the file
  is rewritten, in one rename, with its newest ``KEEP_LOG_BYTES`` (1 MiB, from
  the start of a line) followed by the new bytes. While it rotates the disk
  holds the old file and the new one, so a log and its rotation take at most
  ``MAX_LOG_BYTES + KEEP_LOG_BYTES`` (plus the one write). A reader that had
  the old file open keeps reading it; one that reads by offset sees the file
  get shorter and starts again from 0 (as the API does).
- :class:`Tail` keeps the last bytes of a stream and counts what it dropped.
- :func:`read_pipes` reads a child's pipes into such sinks as it prints, so
  the child never blocks on a full pipe and the reader never holds more than
  its sinks keep.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

__all__ = ["KEEP_LOG_BYTES", "MAX_LOG_BYTES", "Head", "Tail", "append", "newest", "read_pipes"]

MAX_LOG_BYTES = 8 << 20  # a log file is never larger
KEEP_LOG_BYTES = 1 << 20  # what a rotation keeps of it
READ_BYTES = 64 * 1024
POLL_SEC = 0.1  # how often a silent child is checked for having exited
ROTATING = ".rotating"  # the suffix of a rotation being written


def newest(data: bytes, keep: int) -> bytes:
    """The last ``keep`` bytes of ``data``, from the start of a line when it had to be cut.

    A line cut in two would show half of a timestamp, or half of a secret that
    the scrubber no longer recognises; the cut line is dropped whole (unless it
    is all there is, as a line longer than ``keep`` is).
    """
    if len(data) <= keep:
        return data
    cut = data[len(data) - keep :]
    newline = cut.find(b"\n")
    return cut[newline + 1 :] if 0 <= newline < len(cut) - 1 else cut


def append(path: Path, data: bytes, limit: int = MAX_LOG_BYTES, keep: int = KEEP_LOG_BYTES) -> None:
    """Append ``data`` to ``path``, rotating it first when it would pass ``limit`` bytes.

    Writers of one file must not call this at the same time (each caller holds
    its own lock); OSError when the file cannot be written.
    """
    if keep > limit:
        raise ValueError(f"keep ({keep}) must not be larger than limit ({limit})")
    with path.open("ab") as out:
        size = out.seek(0, os.SEEK_END)
        if size + len(data) <= limit:
            out.write(data)
            return
    _rotate(path, data, keep)


def _rotate(path: Path, data: bytes, keep: int) -> None:
    with path.open("rb") as current:
        size = current.seek(0, os.SEEK_END)
        current.seek(max(0, size - keep))
        old = current.read(keep)
    rotated = newest(old + data, keep)
    partial = path.with_name(path.name + ROTATING)
    try:
        with partial.open("wb") as out:
            out.write(rotated)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


class Tail:
    """The last ``limit`` bytes of a stream; ``dropped`` counts the bytes before them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._dropped = 0

    def add(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > 2 * self.limit:  # cut now and then: linear in what passes
            self._cut()

    def _cut(self) -> None:
        excess = len(self._buffer) - self.limit
        if excess > 0:
            del self._buffer[:excess]
            self._dropped += excess

    @property
    def dropped(self) -> int:
        self._cut()
        return self._dropped

    def value(self) -> bytes:
        self._cut()
        return bytes(self._buffer)


class Head:
    """The first ``limit`` bytes of a stream; ``size`` counts every byte that came."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self.size = 0

    def add(self, data: bytes) -> None:
        room = self.limit - len(self._buffer)
        if room > 0:
            self._buffer += data[:room]
        self.size += len(data)

    @property
    def complete(self) -> bool:
        return self.size <= self.limit

    def value(self) -> bytes:
        return bytes(self._buffer)


def read_pipes(
    process: subprocess.Popen[bytes],
    sinks: Mapping[IO[bytes], Callable[[bytes], None]],
    timeout: float,
    on_exit: Callable[[], None] | None = None,
    linger: float = 2.0,
) -> bool:
    """Feed what ``process`` prints on each pipe of ``sinks`` to its sink, as it comes.

    Returns True once the process has exited and its pipes are at their end,
    or ``linger`` seconds after it exited (something it started may hold a pipe
    open: that is not waited for); False when ``timeout`` passed first and the
    process still runs. ``on_exit()`` runs once the process has exited (kill
    what it left behind, so that its pipes end). The pipes are left open.
    """
    deadline = time.monotonic() + timeout
    exited_at: float | None = None
    with selectors.DefaultSelector() as selector:
        for pipe in sinks:
            os.set_blocking(pipe.fileno(), False)
            selector.register(pipe, selectors.EVENT_READ, sinks[pipe])
        while selector.get_map():
            now = time.monotonic()
            if exited_at is None and process.poll() is not None:
                exited_at = now
                if on_exit is not None:
                    on_exit()
            if exited_at is None and now >= deadline:
                return False
            if exited_at is not None and now >= exited_at + linger:
                break
            until = deadline if exited_at is None else exited_at + linger
            for key, _ in selector.select(min(POLL_SEC, until - now)):
                _read(selector, key)
    if exited_at is None:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        if on_exit is not None:
            on_exit()
    return True


def _read(selector: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
    try:
        data = os.read(key.fd, READ_BYTES)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if data:
        key.data(data)
    else:
        selector.unregister(key.fileobj)
