"""What replicas print, each line timestamped, appended to their function's log file.

A replica's stdout and stderr are one pipe that the supervisor reads: user
code's ``print()`` goes straight to fd 1, so only the reader of that pipe can
put a time on every line. One thread reads the pipes of all replicas
(``selectors``), so 200 replicas cost one thread and no polling: it sleeps
until a pipe has something, or a partial line or a note is due.

Every line of a log file is ``<RFC 3339 UTC, ms> [replica <id>] <line>``, the id
the replica's port (replicas of a function share its log: the id tells them
apart); the reconciler's own lines (a replica killed for its memory, one that
ended) read ``<time> [gitops-sless] <what>``. A line that has no newline yet is written
once it has waited ``PARTIAL_SEC`` (a prompt, a progress bar), and what
follows it is a line of its own; a line longer than ``MAX_LINE`` is written
in pieces. Nothing is lost at exit: a pipe is read to its end, and a note
about how a replica ended (``note_after``) is written after its last line.

Files are opened for each write, in append mode: the log goes on across
restarts, and 200 replicas hold no 200 open files. Every write goes through
``logfiles.append``, under one lock: a log never passes ``MAX_LOG_BYTES``
(8 MiB); the write that would take it past rotates it to its newest 1 MiB
of whole lines first, so a replica printing as fast as it can fills no disk,
and its newest lines are what the log keeps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import selectors
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from . import logfiles

__all__ = ["LogPump", "Stream", "stamp", "unstamped"]

log = logging.getLogger(__name__)

PARTIAL_SEC = 0.5
NOTE_WAIT_SEC = 2.0  # a note waits this long for the pipe's last lines (leftovers may hold it)
MAX_LINE = 64 * 1024
READ_BYTES = 64 * 1024
_STAMPED = re.compile(
    rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?:\[replica [^\]\n]*\] )?", re.MULTILINE
)


def stamp() -> str:
    """Now, as the reconciler's logs write it: RFC 3339, UTC, milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def unstamped(data: bytes) -> bytes:
    """``data`` from a log file without the timestamps and replica ids, as printed."""
    return _STAMPED.sub(b"", data)


@dataclass(eq=False)
class Stream:
    """One replica's pipe, read until its end."""

    pipe: IO[bytes]
    path: Path
    prefix: bytes = b""  # b"[replica <id>] ": which replica printed the line
    ended: threading.Event = field(default_factory=threading.Event)
    _partial: bytearray = field(default_factory=bytearray)
    _partial_since: float | None = None
    _notes: list[tuple[float, str]] = field(default_factory=list)  # (due, line)

    def wait(self, timeout: float) -> bool:
        """Whether everything the replica printed is in the file (within ``timeout``)."""
        return self.ended.wait(timeout)


class LogPump:
    """Reads every replica's pipe in one thread; writes timestamped lines."""

    def __init__(
        self, limit: int = logfiles.MAX_LOG_BYTES, keep: int = logfiles.KEEP_LOG_BYTES
    ) -> None:
        self.limit, self.keep = limit, keep
        self._files = threading.Lock()  # one writer at a time: a rotation is not an append
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._new: list[Stream] = []
        self._streams: set[Stream] = set()
        self._closing_at: float | None = None
        self._handing_over = False
        self._thread = threading.Thread(target=self._run, name="sless-replica-logs", daemon=True)
        self._thread.start()

    def attach(self, pipe: IO[bytes], path: Path, replica: str = "") -> Stream:
        """Read ``pipe`` into ``path`` from now on, each line marked with the ``replica``
        that printed it (if given); the pump closes the pipe at its end."""
        os.set_blocking(pipe.fileno(), False)
        stream = Stream(pipe, path, f"[replica {replica}] ".encode() if replica else b"")
        with self._lock:
            self._new.append(stream)
        self._wake()
        return stream

    def note(self, path: Path, line: str) -> None:
        """A line of the reconciler's own, now: what the replica cannot say itself."""
        self._append(path, f"{stamp()} [gitops-sless] {line}\n".encode())

    def note_after(self, stream: Stream, line: str) -> None:
        """A line of the reconciler's own, after the last line the replica printed."""
        with self._lock:
            if not stream.ended.is_set():
                stream._notes.append((time.monotonic() + NOTE_WAIT_SEC, line))
                self._wake()
                return
        self.note(stream.path, line)

    def hand_over(self) -> None:
        """Stop reading, and leave every pipe open: this process re-executes itself, and
        its next image reads them on (a line not ended yet is written as it stands)."""
        with self._lock:
            self._handing_over = True
        self._wake()
        self._thread.join(5)

    def close(self, timeout: float = NOTE_WAIT_SEC) -> None:
        """Read every pipe to its end (for at most ``timeout``), then stop. Safe twice."""
        with self._lock:
            if self._closing_at is None:
                self._closing_at = time.monotonic() + timeout
        self._wake()
        self._thread.join(timeout + 5)

    # --- the reader thread ------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while not self._done():
            try:
                self._step()
            except Exception:  # a replica must never block on a full pipe: keep reading
                log.exception("reading replica output failed")
                time.sleep(0.1)
        for stream in list(self._streams):
            if self._handing_over:
                self._flush(stream)
            else:
                self._end(stream)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _done(self) -> bool:
        with self._lock:
            if self._handing_over:
                return True
            closing = self._closing_at
            idle = not self._streams and not self._new
        return closing is not None and (idle or time.monotonic() >= closing)

    def _step(self) -> None:
        for key, _ in self._selector.select(self._timeout()):
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            else:
                self._read(key.data)
        self._adopt()
        self._due(time.monotonic())

    def _timeout(self) -> float | None:
        with self._lock:
            dues = [s._partial_since + PARTIAL_SEC for s in self._streams if s._partial_since]
            dues += [due for s in self._streams for due, _ in s._notes]
            if self._closing_at is not None:
                dues.append(self._closing_at)
        return max(0.0, min(dues) - time.monotonic()) if dues else None

    def _adopt(self) -> None:
        with self._lock:
            new, self._new = self._new, []
            self._streams.update(new)
        for stream in new:
            self._selector.register(stream.pipe, selectors.EVENT_READ, stream)

    def _read(self, stream: Stream) -> None:
        try:
            data = os.read(stream.pipe.fileno(), READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._lines(stream, data)
        else:
            self._end(stream)

    def _lines(self, stream: Stream, data: bytes) -> None:
        buffer = stream._partial + data
        whole, newline, rest = buffer.rpartition(b"\n")
        lines = whole.split(b"\n") if newline else []
        while len(rest) > MAX_LINE:
            lines.append(rest[:MAX_LINE])
            rest = rest[MAX_LINE:]
        stream._partial = bytearray(rest)
        if not rest:
            stream._partial_since = None
        elif stream._partial_since is None:
            stream._partial_since = time.monotonic()
        self._write(stream, lines)

    def _write(self, stream: Stream, lines: list[bytes]) -> None:
        if lines:
            now = stamp().encode() + b" " + stream.prefix
            self._append(stream.path, b"".join(now + line + b"\n" for line in lines))

    def _flush(self, stream: Stream) -> None:
        partial, stream._partial, stream._partial_since = bytes(stream._partial), bytearray(), None
        if partial:
            self._write(stream, [partial])

    def _due(self, now: float) -> None:
        """Partial lines that waited long enough, and notes whose pipe never ended."""
        for stream in list(self._streams):
            if stream._partial_since and now >= stream._partial_since + PARTIAL_SEC:
                self._flush(stream)
            with self._lock:
                due = [line for at, line in stream._notes if at <= now]
                stream._notes = [(at, line) for at, line in stream._notes if at > now]
            if due:
                self._flush(stream)
            for line in due:
                self.note(stream.path, line)

    def _end(self, stream: Stream) -> None:
        """The pipe is at its end: the last partial line, then the notes that waited for it."""
        self._flush(stream)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(stream.pipe)
        with contextlib.suppress(OSError):
            stream.pipe.close()
        with self._lock:
            self._streams.discard(stream)
            notes, stream._notes = stream._notes, []
            stream.ended.set()
        for _, line in notes:
            self.note(stream.path, line)

    def _append(self, path: Path, data: bytes) -> None:
        try:
            with self._files:
                logfiles.append(path, data, self.limit, self.keep)
        except OSError as exc:
            log.warning("%s: cannot write replica output: %s", path, exc)
