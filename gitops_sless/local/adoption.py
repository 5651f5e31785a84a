"""Replicas handed from a reconciler to the one that replaces it in the same process.

A restart in place (``serve`` re-executing itself, see ``serve.restart``) keeps
the process id, so every replica is still its child: nothing needs to stop.
The old image writes, per function, what the new one cannot find out by
itself: each replica's pid, port and log, the pipe it prints to (its read
end stays open across ``exec``, so no line is lost and the replica never
sees a broken pipe), its memory limit and sandbox uid, and the function's
replica key (the replicas check it on every call). The record travels in an
inherited memory file, never on disk.

The new image rebuilds its units from the records before it answers a call.
A unit's spec lacks the function's environment (its secrets stay out of the
record) until the start-up restore finds the function still serving and hands
the full spec over (``Supervisor.adopt_spec``); until then a replica that
ends is not restarted. A record the new image cannot use (a runtime it does
not have, a replica already gone) is dropped, and its processes are stopped
as any orphan's.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from ..manifests import runtimes
from . import memory
from .replica_logs import LogPump
from .sandbox import Command, Sandbox
from .units import AdoptedProcess, Child, ProcessSpec, Replica, Unit

__all__ = ["restore", "unit_record"]

log = logging.getLogger(__name__)


def spec_record(spec: ProcessSpec) -> dict[str, Any]:
    """What a replica's spec says, but its environment (which holds secrets)."""
    return {
        "env": spec.env_name,
        "function": spec.function,
        "runtime": spec.runtime.name,
        "entrypoint": spec.entrypoint,
        "artifact": str(spec.artifact),
        "timeout_sec": spec.timeout_sec,
        "memory_mb": spec.memory_mb,
        "max_processes": spec.max_processes,
        "revision": spec.revision,
        "stop_grace_sec": spec.stop_grace_sec,
    }


def spec_from_record(record: Mapping[str, Any]) -> ProcessSpec:
    """The spec of :func:`spec_record`, with no environment: enough to stop, limit and
    report the replicas, never to start one. KeyError, TypeError or RuntimeNotFound."""
    return ProcessSpec(
        env_name=record["env"],
        function=record["function"],
        runtime=runtimes.get(record["runtime"]),
        entrypoint=record["entrypoint"],
        artifact=Path(record["artifact"]),
        timeout_sec=float(record["timeout_sec"]),
        env_vars={},
        memory_mb=record["memory_mb"],
        max_processes=record["max_processes"],
        revision=record.get("revision", ""),  # from a release before revisions: ""
        stop_grace_sec=record.get("stop_grace_sec"),  # from a release before streams: None
    )


def keep_open(pipe: IO[bytes]) -> int:
    """A descriptor of ``pipe`` that survives ``exec`` (the read end the next image goes on
    reading); ``pipe`` itself is closed (the same end, under a number of its own)."""
    fd = os.dup(pipe.fileno())
    os.set_inheritable(fd, True)
    pipe.close()
    return fd


def reopen(fd: int) -> IO[bytes] | None:
    """The pipe inherited as ``fd``, as a file the log pump reads; None if it is gone."""
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)  # the replicas started from now on never hold it
        return os.fdopen(fd, "rb", buffering=0)
    return None


def unit_record(unit: Unit, key: str) -> dict[str, Any]:
    """What the next image needs of ``unit`` (``key``: its replica key): its replicas that
    still run keep their pipes open across ``exec``."""
    replicas = []
    for replica in unit.replicas:
        child = replica.child
        stdout = child.process.stdout
        if replica.withdrawn or stdout is None or child.process.poll() is not None:
            continue  # ending, or ended: its restart is the next image's
        replicas.append(
            {
                "pid": child.pid,
                "port": replica.port,
                "log": str(replica.log_path),
                "fd": keep_open(stdout),
                "uid": child.command.uid,
                "cgroup": child.limit.cgroup,
            }
        )
    return {
        "spec": spec_record(unit.spec),
        "spec_hash": unit.spec_hash,
        "wanted": unit.wanted,
        "key": key,
        "replicas": replicas,
    }


def restore(
    record: Mapping[str, Any], guard: memory.MemoryGuard, sandbox: Sandbox, output: LogPump
) -> Unit | None:
    """The unit of :func:`unit_record`, its replicas that still run watched, limited and
    read again; None when this image cannot take it (they are then stopped as orphans)."""
    try:
        spec = spec_from_record(record["spec"])
        spec_hash, wanted = str(record["spec_hash"]), int(record["wanted"])
        wanted_replicas = list(record["replicas"])
    except (KeyError, TypeError, ValueError, runtimes.RuntimeNotFound) as exc:
        log.warning("a replica record from before the restart is unusable: %s", exc)
        return None
    replicas = []
    for entry in wanted_replicas:
        stdout = reopen(entry["fd"])
        process = AdoptedProcess(entry["pid"], stdout)
        if stdout is None or process.poll() is not None:
            if stdout is not None:
                stdout.close()
            continue  # ended while the process restarted: the watcher starts another
        name = f"{spec.env_name}/{spec.function}"
        limit = guard.adopt(
            process.pid, spec.memory_mb, name, spec.max_processes, entry.get("cgroup")
        )
        uid = entry.get("uid")
        if uid is not None and sandbox.uids is not None:
            sandbox.uids.claim(uid)
        child = Child(process, limit, spec, sandbox, Command([], {}, Path("/"), uid))
        log_path = Path(entry["log"])
        replicas.append(
            Replica(
                child, entry["port"], log_path, output.attach(stdout, log_path, str(entry["port"]))
            )
        )
    return Unit(spec, spec_hash, wanted, replicas, adopted=True)
