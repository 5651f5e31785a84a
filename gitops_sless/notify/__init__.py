"""Notifications of deploys and failures (``serve --notify-config``), above the
coordinator, beside ``previews``: what each provider hears of is derived from the
status store after each pass, and sent off the reconcile path.

Modules:

- ``config``: the operator's file, checked against ``schemas/notify.schema.json``,
  and the secrets it names (addresses, HMAC keys) read from ``--secrets-dir``
- ``events``: one thing worth telling (deployed, a failure, resolved, ...)
- ``watch``: the store compared with what each provider was told (incidents, kept
  across restarts in the store's ``notified`` rows)
- ``payloads``: a generic webhook's signed JSON, a Slack Block Kit message, a Teams
  Adaptive Card
- ``delivery``: an outbox per provider: batches, a rate limit, retries with backoff
- ``service``: the notifications of a running server, and the forge's rollout reports

May import: ``state``, ``steps`` (a rollout's verdict), and the shared modules below
them; never ``previews``, ``web`` or ``serve``.
"""

from .config import EVENTS, NotifyConfig, NotifyConfigError, Provider, load
from .events import Event
from .service import Notifications, notifications

__all__ = [
    "EVENTS",
    "Event",
    "Notifications",
    "NotifyConfig",
    "NotifyConfigError",
    "Provider",
    "load",
    "notifications",
]
