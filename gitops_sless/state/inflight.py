"""Long work under way in the background: builds and job runs, each known by its key.

A pass starts work here and does not wait for it beyond its patience; when a
piece finishes, every subscriber asks for another pass, which deploys whatever
could not go on without it. One registry serves every environment of a
server, so a tag that prod is building is not built again for a preview. So a
60 s install holds back only the functions built from it, never a change to
another function.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["InFlight"]

log = logging.getLogger(__name__)


class InFlight:
    def __init__(self, workers: int, name: str = "sless-bg") -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._keys: set[Hashable] = set()
        self._finished = 0  # pieces of work finished so far: wait_any watches it move
        self._changed = threading.Condition()
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, on_done: Callable[[], None]) -> None:
        """Call ``on_done()`` whenever a piece of work finishes (whoever started it: builds
        are shared by every environment that wants the same tag)."""
        with self._changed:
            self._listeners.append(on_done)

    def unsubscribe(self, on_done: Callable[[], None]) -> None:
        with self._changed:
            self._listeners = [f for f in self._listeners if f != on_done]

    def start(self, key: Hashable, task: Callable[[], object]) -> bool:
        """Run ``task`` unless work with ``key`` is already under way; True if started."""
        with self._changed:
            if key in self._keys:
                return False
            self._keys.add(key)
        try:
            self._pool.submit(self._run, key, task)
        except RuntimeError:  # shut down: nothing starts any more
            with self._changed:
                self._keys.discard(key)
            return False
        return True

    def _run(self, key: Hashable, task: Callable[[], object]) -> None:
        try:
            task()
        except Exception:  # a bug in one piece of work must not hide that it ended
            log.exception("background work %r crashed", key)
        finally:
            with self._changed:
                self._keys.discard(key)
                self._finished += 1
                self._changed.notify_all()
                listeners = list(self._listeners)
            for on_done in listeners:
                on_done()

    def under_way(self) -> frozenset[Hashable]:
        with self._changed:
            return frozenset(self._keys)

    def mark(self) -> int:
        """A point to wait from: :meth:`wait_any` returns once work finishes after it."""
        with self._changed:
            return self._finished

    def wait_any(
        self,
        keys: set[Hashable],
        since: int,
        timeout: float,
        interrupted: Callable[[], bool],
    ) -> bool:
        """Until work finishes after ``since`` (True); False once none of ``keys`` is under
        way, ``timeout`` has passed or ``interrupted()`` says so."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._finished == since:
                left = deadline - time.monotonic()
                if not (keys & self._keys) or left <= 0 or interrupted():
                    return False
                # interrupted() is looked at often: a new commit must not wait for this
                self._changed.wait(min(left, 0.05))
            return True

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
