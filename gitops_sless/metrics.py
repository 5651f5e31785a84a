"""Prometheus metrics in the text exposition format, without a client library.

Counters and one histogram are all the reconciler needs; updating one is a
dict increment under the GIL, cheap enough for the proxy's hot path.
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["METRICS", "Counter", "Gauge", "Histogram", "Registry"]

Labels = tuple[tuple[str, str], ...]


def _labels(values: dict[str, str]) -> Labels:
    return tuple(sorted(values.items()))


def _fmt(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    pairs = [*labels, *extra]
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped, strict=True)) + "}"


def _num(value: float) -> str:
    """Exact: ``:g`` would print a Unix time or a byte count as 1.7961e+09."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Counter:
    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.values: dict[Labels, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[_labels(labels)] += amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_fmt(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return lines


class Gauge:
    """A value that goes up and down."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.values: dict[Labels, float] = {}

    def set(self, value: float, **labels: str) -> None:
        self.values[_labels(labels)] = value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        lines += [f"{self.name}{_fmt(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return lines


class Histogram:
    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.name, self.help = name, help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.buckets):
            if seconds <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += seconds

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts, strict=True):
            running += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        lines += [f"{self.name}_sum {_num(self.total)}", f"{self.name}_count {running}"]
        return lines


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.syncs = Counter("sless_syncs_total", "Reconcile passes by environment and result.")
        self.builds = Counter("sless_builds_total", "Builds by runtime and result.")
        self.invocations = Counter(
            "sless_invocations_total", "Calls through /fn/ by environment, function and status."
        )
        self.proxy_unknown = Counter(
            "sless_proxy_unknown_total", "Calls through /fn/ to names no repository declares."
        )
        self.gc_runs = Counter(
            "sless_gc_runs_total", "Garbage collections (of the state folder, or of the cluster)."
        )
        self.gc_reclaimed = Counter(
            "sless_gc_reclaimed_bytes_total",
            "Bytes the garbage collector deleted: artifacts and logs of the state folder "
            "(no label); images, contexts and build records in the cluster (by what).",
        )
        self.gc_objects = Counter(
            "sless_gc_reclaimed_objects_total",
            "Objects the garbage collector deleted in the cluster: image, context or record.",
        )
        self.proxy_latency = Histogram(
            "sless_proxy_latency_seconds", "Time from request to upstream response headers."
        )
        self.build_duration = Histogram(
            "sless_build_duration_seconds",
            "Time a build took, from start to success or failure.",
            (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.sync_duration = Histogram(
            "sless_sync_duration_seconds",
            "Time a reconcile pass took, fetch included.",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.functions = Gauge(
            "sless_functions", "Functions by environment and phase, after the last pass."
        )
        self.last_success = Gauge(
            "sless_last_successful_sync_timestamp_seconds",
            "When the last pass that fetched and converged finished (Unix time), by environment.",
        )

    def render(self) -> str:
        with self._lock:
            parts = [
                self.syncs,
                self.sync_duration,
                self.last_success,
                self.builds,
                self.build_duration,
                self.functions,
                self.invocations,
                self.proxy_unknown,
                self.gc_runs,
                self.gc_reclaimed,
                self.gc_objects,
                self.proxy_latency,
            ]
            return "\n".join(line for part in parts for line in part.render()) + "\n"


METRICS = Registry()
