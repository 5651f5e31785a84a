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
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["FORMATS", "LEVELS", "configure", "event", "redact", "register_secret"]

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
# field order in text lines: where, then what
_WHERE = ("env", "function", "revision", "syncId")
_MIN_SECRET_LEN = 4  # shorter values would mask ordinary words

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
    def format(self, record: logging.LogRecord) -> str:
        name = getattr(record, "event", None) or record.name
        fields: dict[str, Any] = getattr(record, "fields", {})
        where = " ".join(str(fields[k]) for k in _WHERE if k in fields and k != "syncId")
        line = f"{_timestamp(record)} {record.levelname:<7} {name:<18} "
        line += f"{where}: {record.getMessage()}" if where else record.getMessage()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
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
        return redact(json.dumps(out, default=str, ensure_ascii=False))


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
