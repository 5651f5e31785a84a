"""What both halves of bench/sync.py share: statistics, waiting, counting, the report."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gitops_sless.metrics import METRICS

ENV = "prod"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def wait_until(
    what: str,
    predicate: Callable[[], Any],
    timeout: float,
    every: float = 0.05,
    error: type[BaseException] = SystemExit,
) -> Any:
    """The first true value of ``predicate``; ``error`` (the bench stops, by default)
    after ``timeout`` seconds without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise error(f"timed out after {timeout:.0f} s waiting for {what}")


def runtime_pids(root: int) -> set[int]:
    """Runtime processes (servers and job runners) below ``root``, found in /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(fields[1])
    found = set()
    for pid in parents:
        ancestor, hops = parents.get(pid), 0
        while ancestor not in (None, 0, 1, root) and hops < 64:
            ancestor, hops = parents.get(ancestor), hops + 1  # type: ignore[arg-type]
        if ancestor != root:
            continue
        with contextlib.suppress(OSError):
            if os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "bwrap":
                continue  # the sandbox around a runtime, not a runtime
            if b"\0SLESS_FUNCTION_NAME=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                found.add(pid)
    return found


def pass_failure(result: Any) -> str | None:
    """Why a pass failed; None when it did not (work left in flight, "Progressing", did not)."""
    outcome = getattr(result, "result", None)  # older reconcilers had only .error
    if outcome in ("Failed", "Degraded") or (outcome is None and result.error):
        return result.error or outcome
    return None


def metric_builds() -> float:
    return sum(METRICS.builds.values.values())


# --- what the repositories hold ---------------------------------------------------------


def sless_yaml(
    name: str,
    *,
    http: bool = False,
    env: dict[str, str] | None = None,
    job: dict[str, Any] | None = None,
    timeout: int = 30,
) -> str:
    fn: dict[str, Any] = {
        "name": name,
        "runtime": "python3.11",
        "entrypoint": "handler.main",
        "timeoutSec": timeout,
    }
    if env:
        fn["env"] = env
    if http:
        fn["triggers"] = [{"type": "http"}]
    if job:
        fn["jobs"] = [job]
    return json.dumps({"functions": [fn]}, indent=2) + "\n"  # JSON is YAML


GREET = """\
import os


def main(event):
    return {"text": %r, "greeting": os.environ.get("GREETING")}
"""


# --- the report ----------------------------------------------------------------------------


@dataclass
class Report:
    figures: list[tuple[str, str, str]] = field(default_factory=list)  # figure, value, baseline
    targets: list[tuple[str, bool, str]] = field(default_factory=list)

    def figure(self, name: str, value: str, baseline: str = "") -> None:
        self.figures.append((name, value, baseline))
        print(f"  {name}: {value}" + (f"  (baseline: {baseline})" if baseline else ""), flush=True)

    def target(self, name: str, ok: bool, figure: str) -> None:
        self.targets.append((name, ok, figure))

    def print(self) -> None:
        print("\n## Figures\n")
        print("| figure | value | baseline, same run |")
        print("| --- | --- | --- |")
        for name, value, baseline in self.figures:
            print(f"| {name} | {value} | {baseline} |")
        print("\n## Targets\n")
        for name, ok, figure in self.targets:
            print(f"{'PASS' if ok else 'MISS'}  {name:58} {figure}")
