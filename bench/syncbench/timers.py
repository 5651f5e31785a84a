"""Time spent in public calls, per call, summed over threads."""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any


class CallTimers:
    """Exclusive time and calls of public methods, per name, summed over every thread."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.own: defaultdict[str, float] = defaultdict(float)
        self.in_thread: defaultdict[int, float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def wrap_methods(self, obj: Any, label: str) -> None:
        for name, member in inspect.getmembers(type(obj)):
            if not name.startswith("_") and inspect.isfunction(member):
                original = obj.__dict__.get(name)
                setattr(obj, name, self._timed(f"{label}.{name}", getattr(obj, name)))
                self._undo.append(self._restorer(obj, name, original))

    def wrap_function(self, module: Any, name: str) -> None:
        """``module.name``, wherever a gitops_sless module imported it by name."""
        original = getattr(module, name)
        timed = self._timed(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", original)
        for loaded in list(sys.modules.values()):
            if getattr(loaded, "__name__", "").startswith("gitops_sless") and (
                getattr(loaded, name, None) is original
            ):
                setattr(loaded, name, timed)
                self._undo.append(functools.partial(setattr, loaded, name, original))

    @staticmethod
    def _restorer(obj: Any, name: str, original: Any) -> Callable[[], None]:
        def restore() -> None:
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)

        return restore

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _timed(self, key: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # time in timed calls made by this one
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                own = took - stack.pop()
                if stack:
                    stack[-1] += took
                with self._lock:
                    self.calls[key] += 1
                    self.own[key] += own
                    self.in_thread[threading.get_ident()] += own

        return timed

    def table(self, wall: float, thread: int, top: int = 15) -> str:
        lines = [
            "| call | calls | seconds (own, all threads) | mean ms | ÷ wall |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for key, seconds in sorted(self.own.items(), key=lambda kv: -kv[1])[:top]:
            n = self.calls[key]
            lines.append(
                f"| {key} | {n} | {seconds:.2f} | {seconds / n * 1000:.2f} | {seconds / wall:.2f} |"
            )
        mine = self.in_thread.get(thread, 0.0)
        lines.append(
            f"\nthe thread that ran sync(): {mine:.2f} s in these calls, {wall - mine:.2f} s "
            "outside them (the reconciler's own work, e.g. hashing and deciding, and waiting "
            "for its worker threads); all threads together: "
            f"{sum(self.own.values()):.2f} s in these calls"
        )
        return "\n".join(lines)
