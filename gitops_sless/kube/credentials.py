"""The API server's ``Authorization`` header, current whenever it is asked for.

The official client's loaders renew a token they know expires when the header is
asked of them: an exec plugin's (run again within five minutes of its
``expirationTimestamp``) and the in-cluster service account's (its file read again
every minute). What they never do is take a 401 as the sign of a token the server
no longer accepts (revoked, rotated early, or issued without an expiry):
:meth:`Credentials.renew` loads the credentials afresh then, running the exec plugin
again, as kubectl does.

The invoke proxy reads :meth:`Credentials.cached` on its event loop, where running a
plugin would stall every call: it gets the last header at once, and a look for a
newer one runs on a thread when one is due.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kubernetes import client as k8s

__all__ = ["Credentials"]

log = logging.getLogger(__name__)

Loader = Callable[[k8s.Configuration], None]


class Credentials:
    """The header of one ``kubernetes.client.Configuration``, renewed before expiry and on 401."""

    def __init__(
        self, configuration: k8s.Configuration, load: Loader | None = None, look_sec: float = 10.0
    ) -> None:
        """``load`` fills a configuration from the source of the credentials (a kubeconfig
        or the service account); ``look_sec``: how often the token's expiry is looked at."""
        self._configuration = configuration
        self._load = load
        self.look_sec = look_sec
        self._lock = threading.Lock()
        self._looked = float("-inf")
        self._looking = False
        self._header: str | None = None
        self.renewals = 0  # loads after a 401, for the log and the tests
        self.header()

    def header(self) -> str | None:
        """The header for a request now: a token near its expiry is renewed first."""
        with self._lock:
            if time.monotonic() - self._looked >= self.look_sec:
                self._look()
            return self._header

    def cached(self) -> str | None:
        """The last header, without waiting; a look for a newer one starts when due."""
        if time.monotonic() - self._looked >= self.look_sec and not self._looking:
            self._looking = True
            threading.Thread(target=self._look_aside, name="sless-credentials", daemon=True).start()
        return self._header

    def renew(self, refused: str | None) -> str | None:
        """The header after the server refused ``refused`` (401): loaded afresh, unless
        another request renewed it meanwhile. Unchanged when loading fails."""
        with self._lock:
            if self._header != refused:
                return self._header
            if self._load is None:
                return self._header
            fresh = k8s.Configuration()
            try:
                self._load(fresh)
            except Exception as exc:  # the loaders raise anything; the 401 stands
                log.warning("Kubernetes credentials: loading them again failed: %s", exc)
                return self._header
            live = self._configuration
            live.api_key.clear()
            live.api_key.update(fresh.api_key)
            live.api_key_prefix.clear()
            live.api_key_prefix.update(fresh.api_key_prefix)
            live.refresh_api_key_hook = fresh.refresh_api_key_hook
            self.renewals += 1
            self._look()
            log.info("Kubernetes credentials: the API server refused the token; loaded again")
            return self._header

    def _look(self) -> None:
        # the library's hook (run by this call) replaces a token near its expiry
        header = self._configuration.get_api_key_with_prefix("BearerToken", alias="authorization")
        if header and ("\r" in header or "\n" in header):
            raise ValueError("Kubernetes credentials: the token has a line break")
        self._header = header
        self._looked = time.monotonic()

    def _look_aside(self) -> None:
        try:
            self.header()
        except Exception as exc:  # a thread of its own: log, keep the old header
            log.warning("Kubernetes credentials: %s", exc)
        finally:
            self._looking = False
