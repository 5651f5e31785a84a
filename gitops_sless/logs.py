"""Log lines a person at the terminal (or a log shipper) can act on, and never a secret.

Every decision is one line, emitted with :func:`event`: a dotted event name
(``sync.finished``, ``build.failed``) plus fields that say which environment,
function, revision and sync it concerns. :func:`configure` picks the format:

- ``text``: ``2026-12-01T10:00:00.123Z INFO  sync.finished  prod abc1234: Succeeded (…)``
- ``json``: one object per line with ``time``, ``level``, ``event``, ``message``
  and the fields that apply (``env``, ``function``, ``revision``, ``syncId``, …).

Secret values (API token, webhook secret, git password, values read from the
secrets folder) are registered with :func:`register_secret`; the handler
replaces them with ``***`` in every line, whatever logged them.

Neither format can be forged by what it prints: a job's result, a build's error
or a PR title may hold a newline followed by something that looks like a log
line. The text format escapes every control character (``\\n``, ``\\r``,
``\\t``, ``\\xNN``, ``\\uNNNN`` for the Unicode line and paragraph separators)
and the backslash itself (``\\\\``) in every value it prints, so one record is
one line and the escaping can be undone; only a traceback continues a record,
on lines indented by four spaces. The JSON format escapes them as JSON does,
and also DEL, the C1 controls and U+2028/U+2029, which ``str.splitlines`` and
some viewers take for line ends.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["FORMATS", "LEVELS", "configure", "escape", "event", "redact", "register_secret"]

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
# field order in text lines: where, then what
_WHERE = ("env", "function", "revision", "syncId")
_MIN_SECRET_LEN = 4  # shorter values would mask ordinary words
# C0 and C1 controls, DEL, and the Unicode separators that some readers end a line at
_UNSAFE = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# what json.dumps(ensure_ascii=False) leaves raw that a reader may take for a line end
_JSON_UNSAFE = re.compile(r"[\x7f-\x9f\u2028\u2029]")

_secrets: frozenset[str] = frozenset()
_secrets_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Never let ``value`` appear in a log line from now on."""
    global _secrets
    if not value or len(value) < _MIN_SECRET_LEN:
        return
    with _secrets_lock:
        _secrets = _secrets | {value}


def redact(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):  # longest first: no partial leaks
        if secret in text:
            text = text.replace(secret, "***")
    return text


def _escaped(found: re.Match[str]) -> str:
    char = found.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def escape(text: str) -> str:
    """``text`` on one line: control characters and the backslash escaped, reversibly."""
    return _UNSAFE.sub(_escaped, text)


def _clean(value: object) -> str:
    """A value as the text format prints it: secrets masked first, then escaped."""
    return escape(redact(str(value)))


def event(
    logger: logging.Logger, name: str, message: str, *, level: int = logging.INFO, **fields: Any
) -> None:
    """Log one event: ``name`` is dotted (``build.finished``), fields say where and what."""
    if logger.isEnabledFor(level):
        clean = {k: v for k, v in fields.items() if v is not None}
        logger.log(level, message, extra={"event": name, "fields": clean})


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """One record, one line: every value escaped (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        name = _clean(getattr(record, "event", None) or record.name)
        fields: dict[str, Any] = getattr(record, "fields", {})
        where = " ".join(_clean(fields[k]) for k in _WHERE if k in fields and k != "syncId")
        message = _clean(record.getMessage())
        line = f"{_timestamp(record)} {record.levelname:<7} {name:<18} "
        line += f"{where}: {message}" if where else message
        if record.exc_info:
            trace = self.formatException(record.exc_info).splitlines()
            line += "".join(f"\n    {_clean(part)}" for part in trace)
        return redact(line)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "event": getattr(record, "event", None) or record.name,
            "message": record.getMessage(),
        }
        for key, value in getattr(record, "fields", {}).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        text = redact(json.dumps(out, default=str, ensure_ascii=False))
        # only inside strings (JSON's structure is ASCII), where \uNNNN means the same
        return _JSON_UNSAFE.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


def configure(fmt: str = "text", level: str = "info", stream: TextIO | None = None) -> None:
    """Send every log line of the process to ``stream`` (stderr) in ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)}")
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: use one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # libraries speak only when something is wrong: one line per poll or request is noise
    for noisy in ("apscheduler", "uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
