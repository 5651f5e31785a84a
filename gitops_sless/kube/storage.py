"""The S3 bucket that holds build contexts for kaniko, one object per build tag.

A context is uploaded once: tags are content-derived, so an object that exists
already holds the same bytes. Every failure becomes one line naming the
endpoint and the bucket and what went wrong: a network error or a server error
is a ``StorageUnavailable`` (retry later), refused credentials or a missing
bucket a ``StorageError`` (fix the configuration). The secret key never
appears in a message or a log line.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore import exceptions as boto
from botocore.config import Config

from .. import logs
from ..errors import PermanentError, TransientError

__all__ = ["ContextStore", "S3Config", "StorageError", "StorageUnavailable", "StoredContext"]

CONNECT_TIMEOUT_SEC = 3
READ_TIMEOUT_SEC = 15
MAX_ATTEMPTS = 3  # the first try included
PROBE_PREFIX = "probes/"
CONTEXT_PREFIX = "contexts/"
CONTEXT_SUFFIX = ".tar.gz"
PRESIGN_SEC = 15 * 60  # a build pod fetches its context at start; a later retry signs anew
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_CREDENTIALS = "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
_AUTH_CODES = frozenset(
    {
        "403",
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AuthorizationHeaderMalformed",
    }
)
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_BUSY_CODES = frozenset({"SlowDown", "RequestTimeout", "Throttling", "ServiceUnavailable"})


class StorageError(PermanentError):
    """The bucket refuses us or does not exist: retrying will not help."""


class StorageUnavailable(TransientError):
    """The bucket cannot be reached now (network, timeouts, server errors)."""


@dataclass(frozen=True)
class S3Config:
    endpoint: str  # with scheme, e.g. http://127.0.0.1:8333
    bucket: str
    region: str = "us-east-1"
    access_key: str = field(repr=False, default="")
    secret_key: str = field(repr=False, default="")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> S3Config:
        """The bucket named by ``SLESS_S3_*``, with the ``AWS_*`` keys; the secret is redacted."""
        missing = [n for n in ("SLESS_S3_ENDPOINT", "SLESS_S3_BUCKET") if not environ.get(n)]
        if missing:
            raise StorageError(f"S3 storage for build contexts: {' and '.join(missing)} not set")
        endpoint = environ["SLESS_S3_ENDPOINT"].rstrip("/")
        if not endpoint.startswith(("http://", "https://")):
            raise StorageError(
                f"SLESS_S3_ENDPOINT={endpoint}: give the scheme, http:// or https://"
            )
        secret = environ.get("AWS_SECRET_ACCESS_KEY", "")
        logs.register_secret(secret)
        return cls(
            endpoint=endpoint,
            bucket=environ["SLESS_S3_BUCKET"],
            region=environ.get("SLESS_S3_REGION") or "us-east-1",
            access_key=environ.get("AWS_ACCESS_KEY_ID", ""),
            secret_key=secret,
        )


@dataclass(frozen=True)
class StoredContext:
    """One context in the bucket, as garbage collection weighs it."""

    key: str
    tag: str
    size: int
    modified: float  # Unix time of its upload


class ContextStore:
    """Build contexts in one bucket, under ``contexts/<tag>.tar.gz``.

    The keys need ``s3:ListBucket`` (without it S3 tells a missing object as a
    refusal), ``s3:GetObject`` and ``s3:PutObject``, and ``s3:DeleteObject`` on
    ``probes/`` for the start-up check and on ``contexts/`` for garbage collection.
    """

    def __init__(self, config: S3Config) -> None:
        self.config = config
        logs.register_secret(config.secret_key)
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.endpoint,
            region_name=config.region,
            # empty keys: boto3's own chain (a web identity, an instance role)
            aws_access_key_id=config.access_key or None,
            aws_secret_access_key=config.secret_key or None,
            config=Config(
                s3={"addressing_style": "path"},
                signature_version="s3v4",
                connect_timeout=CONNECT_TIMEOUT_SEC,
                read_timeout=READ_TIMEOUT_SEC,
                retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
                # S3-compatible servers do not all know the newer default checksums
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def key(self, tag: str) -> str:
        if not _TAG.fullmatch(tag):
            raise ValueError(f"{tag!r} is not a build tag")
        return f"{CONTEXT_PREFIX}{tag}{CONTEXT_SUFFIX}"

    def contexts(self) -> list[StoredContext]:
        """Every context in the bucket, with its size and upload time (page by page)."""
        found: list[StoredContext] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket, Prefix=CONTEXT_PREFIX
            )
            for page in pages:
                found += [c for item in page.get("Contents") or [] if (c := _context(item))]
        except (boto.ClientError, boto.BotoCoreError) as exc:
            raise self._error(exc, f"cannot list {CONTEXT_PREFIX}") from exc
        return found

    def delete(self, key: str) -> None:
        """Delete ``key`` (deleting a missing key is no error in S3)."""
        try:
            self._client.delete_object(Bucket=self.config.bucket, Key=key)
        except (boto.ClientError, boto.BotoCoreError) as exc:
            raise self._error(exc, f"cannot delete {key}") from exc

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.config.bucket, Key=key)
        except boto.ClientError as exc:
            if _code(exc) in _MISSING_CODES:
                return False
            raise self._error(exc, f"cannot read {key}") from exc
        except boto.BotoCoreError as exc:
            raise self._error(exc, f"cannot read {key}") from exc
        return True

    def upload_if_absent(self, key: str, data: bytes) -> bool:
        """Upload ``data`` as ``key`` unless it exists; True when it uploaded."""
        if self.exists(key):
            return False
        try:
            self._client.put_object(
                Bucket=self.config.bucket, Key=key, Body=data, ContentType="application/gzip"
            )
        except (boto.ClientError, boto.BotoCoreError) as exc:
            raise self._error(exc, f"cannot write {key}") from exc
        return True

    def presigned_get(self, key: str, expires_sec: int = PRESIGN_SEC) -> str:
        """A URL that reads ``key`` for ``expires_sec`` with no key of ours: what a build pod
        gets instead of credentials (signing is local: no request is made)."""
        try:
            return str(
                self._client.generate_presigned_url(
                    "get_object",
                    Params={"Bucket": self.config.bucket, "Key": key},
                    ExpiresIn=expires_sec,
                )
            )
        except (boto.ClientError, boto.BotoCoreError) as exc:
            raise self._error(exc, f"cannot presign {key}") from exc

    def check(self) -> None:
        """At start-up: the bucket answers, and takes and deletes a probe object."""
        bucket = self.config.bucket
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        steps: list[tuple[str, Any]] = [
            ("", lambda: self._client.head_bucket(Bucket=bucket)),
            ("cannot write", lambda: self._client.put_object(Bucket=bucket, Key=probe, Body=b"")),
            ("cannot delete", lambda: self._client.delete_object(Bucket=bucket, Key=probe)),
        ]
        for what, step in steps:
            try:
                step()
            except (boto.ClientError, boto.BotoCoreError) as exc:
                error = self._error(exc, what)
                # at start-up even a network failure stops: nothing works without the bucket
                raise StorageError(str(error)) from exc

    def _error(self, exc: Exception, what: str) -> StorageError | StorageUnavailable:
        transient, problem = _problem(exc)
        where = f"S3 bucket {self.config.bucket} at {self.config.endpoint}"
        line = f"{where}: {what}: {problem}" if what else f"{where}: {problem}"
        if self.config.secret_key:
            line = line.replace(self.config.secret_key, "***")
        return StorageUnavailable(line) if transient else StorageError(line)


def _context(item: Mapping[str, Any]) -> StoredContext | None:
    key = str(item.get("Key") or "")
    tag = key.removeprefix(CONTEXT_PREFIX).removesuffix(CONTEXT_SUFFIX)
    if not key.endswith(CONTEXT_SUFFIX) or not _TAG.fullmatch(tag):
        return None  # not one of ours
    modified = item.get("LastModified")
    # no upload time: counted as new, so it is never collected by mistake
    stamp = modified.timestamp() if modified is not None else time.time()
    return StoredContext(key, tag, int(item.get("Size") or 0), stamp)


def _code(exc: boto.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _problem(exc: Exception) -> tuple[bool, str]:
    """(transient, what went wrong in a few words) for a boto3 error."""
    if isinstance(exc, boto.ClientError):
        code = _code(exc)
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in _AUTH_CODES or status == 403:
            named = "" if code.isdigit() else f"{code}; "
            return False, f"access denied ({named}{_CREDENTIALS})"
        if code == "NoSuchBucket" or (status == 404 and code in _MISSING_CODES):
            return False, "bucket does not exist"
        if status >= 500 or code in _BUSY_CODES:
            return True, f"server error {status} {code}".rstrip()
        return False, f"refused: {code or 'HTTP'} {status}"
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
        return False, f"no credentials ({_CREDENTIALS})"
    if isinstance(exc, boto.ConnectTimeoutError):
        return True, f"unreachable (no connection within {CONNECT_TIMEOUT_SEC} s)"
    if isinstance(exc, boto.ReadTimeoutError):
        return True, f"no answer within {READ_TIMEOUT_SEC} s"
    if isinstance(exc, boto.ConnectionError):
        cause = str(exc.kwargs.get("error", "")).lower()
        if "refused" in cause:
            return True, "unreachable (connection refused)"
        if "name or service not known" in cause or "name resolution" in cause:
            return True, "unreachable (host name not found)"
        return True, "unreachable (connection failed)"
    return True, type(exc).__name__
