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

    def replace(self, values: list[tuple[float, dict[str, str]]]) -> None:
        """Every series at once: one that is not named any more is gone."""
        self.values = {_labels(labels): value for value, labels in values}

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        lines += [f"{self.name}{_fmt(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return lines


class Histogram:
    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.name, self.help = name, help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # of observations without labels
        self.total = 0.0
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}  # with labels

    def observe(self, seconds: float) -> None:
        counts = self.counts
        for i, bound in enumerate(self.buckets):
            if seconds <= bound:
                counts[i] += 1
                break
        else:
            counts[-1] += 1
        self.total += seconds

    def observe_labelled(self, seconds: float, **labels: str) -> None:
        """:meth:`observe` in the series of ``labels`` (apart: the proxy observes without)."""
        key = _labels(labels)
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = ([0] * (len(self.buckets) + 1), [0.0])
        counts, total = series
        total[0] += seconds
        for i, bound in enumerate(self.buckets):
            if seconds <= bound:
                counts[i] += 1
                break
        else:
            counts[-1] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        every = [((), self.counts, self.total)] if not self.series or any(self.counts) else []
        every += [(k, c, t[0]) for k, (c, t) in sorted(self.series.items())]
        for labels, counts, total in every:
            running = 0
            for bound, count in zip((*self.buckets, "+Inf"), counts, strict=True):
                running += count
                le = _fmt(labels, (("le", str(bound)),))
                lines.append(f"{self.name}_bucket{le} {running}")
            lines += [f"{self.name}_sum{_fmt(labels)} {_num(total)}"]
            lines += [f"{self.name}_count{_fmt(labels)} {running}"]
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
        self.cold_start = Histogram(
            "sless_cold_start_seconds",
            "Cold starts: a call that waited for a replica to start, by environment, function, "
            "runtime and phase: process (sandbox and interpreter start), runtime (the runtime's "
            "imports), handler (the handler's import), ready (listening until the call was "
            "sent), answer (sent until the response head) and total (arrival to response head).",
            (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.replicas = Gauge(
            "sless_function_replicas",
            "Replicas of an autoscaled function by environment, function and kind: desired "
            "(the autoscaler's decision) or ready (serving).",
        )
        self.open_connections = Gauge(
            "sless_open_connections",
            "Streamed responses (kind stream) and WebSockets (kind websocket) open through "
            "this server's proxy now, by environment and function.",
        )
        self.concurrency = Gauge(
            "sless_function_concurrency",
            "Calls in flight through the proxy (waiting ones included), averaged over the "
            "autoscaler's stable window, by environment and function.",
        )
        self.reconciler_replicas = Gauge(
            "sless_reconciler_replicas",
            "Replicas of the reconciler up, as this one counts them (member leases; each "
            "enforces 1/N of every rateLimit).",
        )
        self.idle_functions = Counter(
            "sless_scaled_to_zero_total",
            "Times an autoscaled function stopped its last replica after its idle time.",
        )
        self.async_submitted = Counter(
            "sless_async_submitted_total",
            "Asynchronous invocations accepted (202), by environment and function.",
        )
        self.async_attempts = Counter(
            "sless_async_attempts_total",
            "Attempts of asynchronous invocations by environment, function and outcome: "
            "succeeded, failed (a final 4xx), retried, dead.",
        )
        self.async_dead = Counter(
            "sless_async_dead_total",
            "Asynchronous invocations that became dead letters, by environment and function.",
        )
        self.async_invocations = Gauge(
            "sless_async_invocations",
            "Asynchronous invocations kept, by environment, function and status (queued is "
            "the queue's depth), as the queue engine last counted them.",
        )
        self.async_oldest = Gauge(
            "sless_async_oldest_queued_seconds",
            "Age of the oldest queued asynchronous invocation, by environment and function.",
        )
        self.revision_switches = Counter(
            "sless_revision_switches_total",
            "Rollbacks and unpins asked for, by environment, function, action (rollback, "
            "unpin: by hand; unpinned: by a commit that changed the function) and who.",
        )
        self.notifications = Counter(
            "sless_notifications_total",
            "Notification messages by provider and result: delivered, retried (tried again "
            "later), dropped (refused by the receiver, or too many waiting).",
        )
        self.notification_events = Counter(
            "sless_notification_events_total",
            "Events queued for a notification provider, by provider and event.",
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
                self.cold_start,
                self.replicas,
                self.concurrency,
                self.open_connections,
                self.idle_functions,
                self.reconciler_replicas,
                self.async_submitted,
                self.async_attempts,
                self.async_dead,
                self.async_invocations,
                self.async_oldest,
                self.revision_switches,
                self.notifications,
                self.notification_events,
            ]
            return "\n".join(line for part in parts for line in part.render()) + "\n"


METRICS = Registry()
