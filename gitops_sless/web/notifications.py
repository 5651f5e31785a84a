"""The API of notifications: each provider of ``--notify-config``, its last delivery and
error, never its address (an address is a secret). Reads need a read token, like the
rest of the status; the route answers under ``/api/v1/`` and ``/api/``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Security
from fastapi.security import HTTPBearer
from pydantic import Field

from . import replies
from .models import ApiModel, Timestamp

__all__ = ["NotificationProvider", "NotificationStatus", "router"]

_READ = [Security(HTTPBearer(auto_error=False))]


class NotificationProvider(ApiModel):
    name: str
    kind: Literal["webhook", "slack", "teams", "forge"]
    pending: int = Field(0, description="events waiting to be sent")
    last_attempt: Timestamp | None = Field(None, description="when a message was last sent")
    last_delivered: Timestamp | None = Field(None, description="when one was last accepted")
    last_ok: bool | None = Field(None, description="whether the last attempt was accepted")
    last_error: str | None = Field(None, description="why the last attempt failed")
    delivered: int = Field(0, description="messages accepted")
    retried: int = Field(0, description="attempts that failed and are tried again")
    dropped: int = Field(0, description="messages refused by the receiver, or too many")
    events: int = Field(0, description="events queued for it")


class NotificationStatus(ApiModel):
    providers: list[NotificationProvider]


def router(status: Callable[[], list[dict[str, Any]]]) -> APIRouter:
    api = APIRouter(tags=["notifications"])

    @api.get("/api/v1/notifications", dependencies=_READ, responses=replies.errors(401))
    @api.get("/api/notifications", include_in_schema=False)
    def notifications() -> NotificationStatus:
        """Each notification provider: its last delivery, success and error, its counts."""
        shown = [{k: v for k, v in p.items() if k != "enabled"} for p in status()]
        return NotificationStatus(providers=[NotificationProvider(**p) for p in shown])

    return api
