"""Shared by both functions of this folder: open a connection from $PG_DSN."""
import os
from urllib.parse import parse_qs, unquote, urlsplit

import pg8000.native


def connect():
    """Connect with a DSN like postgresql://user:password@host:5432/dbname[?sslmode=require]."""
    dsn = os.environ.get("PG_DSN")
    if not dsn:
        raise RuntimeError("PG_DSN is not set (Secret notes-db, key dsn)")
    url = urlsplit(dsn)
    if url.scheme not in ("postgres", "postgresql"):
        raise RuntimeError("PG_DSN must be a postgresql:// URL")
    sslmode = parse_qs(url.query).get("sslmode", ["disable"])[0]
    return pg8000.native.Connection(
        user=unquote(url.username or "postgres"),
        password=unquote(url.password) if url.password else None,
        host=url.hostname or "localhost",
        port=url.port or 5432,
        database=unquote(url.path.lstrip("/")) or None,
        ssl_context=True if sslmode in ("require", "verify-ca", "verify-full") else None,
        timeout=10,
    )
