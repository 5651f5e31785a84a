"""One kind in one namespace, kept in memory by a LIST and then a WATCH (an informer).

A pass reads the cache: when nothing changed it makes no request at all. The
cache is only ever as old as the watch is late, and it knows when it cannot
be trusted:

* it is *fresh* after a LIST; a watch error (a cut stream, an unreachable
  server, ``410 Gone``) makes it stale until it is fresh again;
* a cut watch is resumed from the last ``resourceVersion`` seen (events and
  bookmarks both move it), and a ``BOOKMARK`` on the resumed stream vouches
  that everything up to it has arrived: fresh again, without a LIST;
* ``410 Gone`` (that version is older than the server's history) is
  followed at once by a LIST, in the background;
* :meth:`Informer.sync`, called before every plan, LISTs when the cache is
  stale (the pass waits for a relist already under way rather than making
  another), so a pass never plans from a cache a watch error has left behind;
* every ``resync_sec`` (default 30 min) the watcher LISTs anyway, between two
  watch streams: a bound on how long an event lost to a bug anywhere between
  etcd and here (an API server's watch cache after a failover, a proxy) can
  go unnoticed, for one LIST per kind per half hour instead of one per pass.

Writes update the cache with the object the API server returned
(:meth:`Informer.put`); a watch event older than what the cache holds never
replaces it (resourceVersions compared as the integers etcd makes them).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import SlessError
from .client import Expired, KubeClient

# a generator of its own: the global one stays the caller's (seeded tests, hypothesis)
_random = random.Random()

__all__ = ["Informer"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Handler = Callable[[Obj | None, Obj | None], None]  # (new, old): None when absent


def _rv(obj: Obj | None) -> int:
    text = str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else -1


class Informer:
    """The objects of ``kind`` in ``namespace`` (None: cluster-wide) with ``selector``."""

    def __init__(
        self,
        client: KubeClient,
        kind: str,
        namespace: str | None,
        selector: Mapping[str, str],
        *,
        on_change: Handler | None = None,
        after_change: Callable[[], None] | None = None,
        transform: Callable[[Obj], Obj] = lambda obj: obj,
        watch_sec: tuple[float, float] = (300.0, 600.0),
        resync_sec: float = 1800.0,
        backoff_sec: tuple[float, float] = (0.2, 10.0),
        lock: threading.RLock | None = None,
    ) -> None:
        """``watch_sec``: each watch asks the server to end it after a random time in that
        range (client-go's 5 to 10 min), so that a fleet of replicas does not reconnect at
        once; ``on_change(new, old)`` hears every change to the cache, under ``lock`` (shared
        by the informers of one view, so that its index changes with the objects);
        ``after_change()`` is called after each change once ``lock`` is released (it may
        take other locks, and read the cache)."""
        self.client = client
        self.kind = kind
        self.namespace = namespace
        self.selector = dict(selector)
        self.on_change = on_change
        self.after_change = after_change
        self.transform = transform
        self.watch_sec = watch_sec
        self.resync_sec = resync_sec
        self.backoff_sec = backoff_sec
        self.fresh = False  # listed, and no watch error since (or a bookmark after it)
        self.relists = 0
        self._objects: dict[str, Obj] = {}
        self._rv = ""  # where the watch resumes
        self._epoch = 0  # bumped by every LIST: a stream from before it is dropped
        self._listed_at = 0.0
        self._lock = lock or threading.RLock()
        self._list_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._changes = threading.Condition()  # its own lock: waiters never hold ``_lock``
        self._seq = 0  # bumped by every change to the cache or to its freshness

    # --- reading ---------------------------------------------------------------------------

    def get(self, name: str) -> Obj | None:
        with self._lock:
            return self._objects.get(name)

    def items(self) -> list[Obj]:
        with self._lock:
            return list(self._objects.values())

    def __len__(self) -> int:
        return len(self._objects)

    # --- waiting ---------------------------------------------------------------------------

    def version(self) -> int:
        """A number that changes with the cache: pass it to :meth:`wait_change`."""
        with self._changes:
            return self._seq

    def wait_change(self, since: int, timeout: float) -> bool:
        """Wait until the cache changed after ``version() == since``; False on timeout."""
        with self._changes:
            return self._changes.wait_for(lambda: self._seq != since, timeout)

    def _notify(self) -> None:
        # called after ``_lock`` is released: a waiter reads the cache between two waits
        with self._changes:
            self._seq += 1
            self._changes.notify_all()
        if self.after_change is not None:
            try:
                self.after_change()
            except Exception:  # a listener's bug must not stop the watch
                log.exception("after a change of %s %s", self.kind, self._where())

    # --- keeping it true -------------------------------------------------------------------

    def sync(self) -> None:
        """Make the cache fit for a pass: a LIST when it is stale; the watch running."""
        with self._list_lock:
            if not self.fresh:
                self._relist()
            if self._thread is None:  # under the lock: two first passes start one watcher
                self._thread = threading.Thread(
                    target=self._run, name=f"sless-watch-{self.kind}", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._notify()  # a wait on it ends (see ``stopped``)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def put(self, obj: Obj) -> None:
        """``obj`` as a write returned it (never older than what is cached)."""
        self._upsert(self.transform(obj))

    def drop(self, name: str) -> None:
        """Deleted by this process: gone from the cache now, not when the event comes."""
        with self._lock:
            old = self._objects.pop(name, None)
            if old is not None and self.on_change:
                self.on_change(None, old)
        self._notify()

    def _relist(self) -> None:
        items, rv = self.client.list_versioned(self.kind, self.namespace, self.selector)
        fresh = {obj["metadata"]["name"]: self.transform(obj) for obj in items}
        with self._lock:
            old, self._objects = self._objects, fresh
            self._rv, self._epoch = rv, self._epoch + 1
            self._listed_at = time.monotonic()
            self.fresh = True
            self.relists += 1
            if self.on_change:
                for name in old.keys() - fresh.keys():
                    self.on_change(None, old[name])
                for name, obj in fresh.items():
                    self.on_change(obj, old.get(name))
        self._notify()

    def _upsert(self, obj: Obj, epoch: int | None = None) -> None:
        """Cache ``obj`` unless the cache holds a newer version, or a LIST came since the
        stream (``epoch``) it arrived on started."""
        name = obj["metadata"]["name"]
        with self._lock:
            old = self._objects.get(name)
            if epoch is not None and epoch != self._epoch:
                return
            if old is not None and _rv(old) >= _rv(obj) >= 0:
                return  # an event from before a write whose answer is already here (or the same)
            self._objects[name] = obj
            if self.on_change:
                self.on_change(obj, old)
        self._notify()

    def _delete(self, obj: Obj, epoch: int) -> None:
        name = obj["metadata"]["name"]
        with self._lock:
            old = self._objects.get(name)
            if epoch != self._epoch or old is None or _rv(old) > _rv(obj):
                return  # created again since
            del self._objects[name]
            if self.on_change:
                self.on_change(None, old)
        self._notify()

    # --- the watcher thread ----------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self._resync_due():
                    with self._list_lock:
                        self._relist()
                started = time.monotonic()
                self._stream(resumed=not self.fresh)
                # a stream the server ends at once (a kind it no longer serves) is no loop
                failures = 0 if time.monotonic() - started > 1 else failures + 1
                self._stop.wait(self._backoff(failures) if failures else 0)
            except Expired as exc:
                log.info("watch %s %s: %s; listing again", self.kind, self._where(), exc)
                self.fresh = False
                failures = self._relist_later(failures)
            except SlessError as exc:
                log.info("watch %s %s: %s; resuming", self.kind, self._where(), exc)
                self.fresh = False
                failures += 1
                self._stop.wait(self._backoff(failures))
            except Exception:  # a watcher that dies leaves the cache stale forever
                log.exception("watch %s %s", self.kind, self._where())
                self.fresh = False
                failures += 1
                self._stop.wait(self._backoff(failures))

    def _relist_later(self, failures: int) -> int:
        try:
            with self._list_lock:
                if not self.fresh:
                    self._relist()
            return 0
        except SlessError as exc:
            log.info("list %s %s: %s", self.kind, self._where(), exc)
            self._stop.wait(self._backoff(failures + 1))
            return failures + 1

    def _stream(self, resumed: bool) -> None:
        """One watch from where the cache is, until the server ends it (or a LIST restarts)."""
        with self._lock:
            rv, epoch = self._rv, self._epoch
        if not rv:  # the kind is not served (a CRD not installed): look again later
            self._stop.wait(min(60.0, self.resync_sec))
            with self._list_lock:
                self._relist()
            return
        timeout = _random.uniform(*self.watch_sec)
        events = self.client.watch(self.kind, self.namespace, self.selector, rv, timeout)
        for event in self._current(events, epoch):
            obj, kind = event.get("object") or {}, event.get("type")
            if kind == "BOOKMARK":
                resumed = self._bookmark(obj, epoch, resumed)
                continue
            if kind == "DELETED":
                self._delete(obj, epoch)
            elif kind in ("ADDED", "MODIFIED"):
                self._upsert(self.transform(obj), epoch)
            self._advance(obj, epoch)

    def _current(self, events: Iterator[Obj], epoch: int) -> Iterator[Obj]:
        """The stream's events while no LIST has replaced what it started from."""
        try:
            for event in events:
                if self._stop.is_set() or self._epoch != epoch:
                    return
                yield event
        finally:
            close = getattr(events, "close", None)
            if close:
                close()

    def _bookmark(self, obj: Obj, epoch: int, resumed: bool) -> bool:
        self._advance(obj, epoch)
        if resumed:  # everything up to here has come: the cache is whole again
            with self._lock:
                if self._epoch == epoch:
                    self.fresh = True
            self._notify()
        return False

    def _advance(self, obj: Obj, epoch: int) -> None:
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        with self._lock:
            if rv and self._epoch == epoch:
                self._rv = rv

    def _resync_due(self) -> bool:
        return self.fresh and time.monotonic() - self._listed_at >= self.resync_sec

    def _backoff(self, failures: int) -> float:
        low, high = self.backoff_sec
        return min(low * 2 ** max(failures - 1, 0), high) * (0.5 + _random.random() / 2)

    def _where(self) -> str:
        return f"in {self.namespace}" if self.namespace else "(cluster)"
