"""Restart in place: on SIGUSR2 ``serve`` re-executes itself, and no call goes unanswered.

What callers would otherwise meet in a restart (stop, then start): a closed
port for as long as the new process takes to listen, and every local replica
stopped and started again. Here neither happens:

- the listening sockets stay open across ``exec``: a caller that connects
  while the next image starts waits in the kernel's backlog and is answered
  by it; calls under way are answered by the old image first, as in any
  graceful stop;
- the process id stays the same, so the local backend's replicas are still
  its children: they serve on, and the next image adopts them
  (``local.adoption``), their logs read on from the same pipes.

So an upgrade is: install the new version, then ``kill -USR2`` the server (a
service manager's reload: ``ExecReload=kill -USR2 $MAINPID``). SIGUSR2, not
SIGHUP: a terminal that closes sends SIGHUP, and that must stop ``serve``, not
restart it under a terminal that is gone. (gunicorn and unicorn use USR2 for
the same re-execution.)

The sockets are passed as descriptor numbers in ``SLESS_LISTEN_FDS``, the
handed-over state in an anonymous memory file (``SLESS_HANDOFF_FD``): never
on disk, since it holds the functions' replica keys.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from .. import logs

__all__ = ["Restart", "take_handoff"]

log = logging.getLogger(__name__)

SIGNAL = signal.SIGUSR2
LISTEN_ENV = "SLESS_LISTEN_FDS"
HANDOFF_ENV = "SLESS_HANDOFF_FD"


def take_handoff() -> Any:
    """What the previous image handed over (None when this process did not restart)."""
    fd = os.environ.pop(HANDOFF_ENV, None)
    if fd is None:
        return None
    try:
        with os.fdopen(int(fd), "rb") as file:
            return json.loads(file.read())
    except (OSError, ValueError) as exc:
        # its replicas are then orphans: stopped, and started again by the restore
        log.warning("the state handed over by the previous image is unreadable: %s", exc)
        return None


class Restart:
    """The listening sockets of one ``serve`` process, and its restart when asked."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._held: list[int] = []  # a second descriptor of each socket: uvicorn closes its own
        self._inherited = [int(fd) for fd in os.environ.pop(LISTEN_ENV, "").split(",") if fd]
        self._stop: Callable[[], None] | None = None
        # from now on, before anything starts: a request that comes early is kept, and
        # acted on once the servers run (SIGUSR2's default would end the process); only the
        # main thread may (a server made in a test's thread restarts by no signal)
        if threading.current_thread() is threading.main_thread():
            signal.signal(SIGNAL, self._signalled)

    @property
    def restarted(self) -> bool:
        """This image took its sockets over from the previous one."""
        return bool(self._inherited)

    def sockets(self, configs: list[Any]) -> list[socket.socket]:
        """A listening socket for each ``uvicorn.Config``: the previous image's, in order,
        or bound now (uvicorn exits 3 when the port is taken)."""
        if len(self._inherited) == len(configs):
            sockets = [socket.socket(fileno=fd) for fd in self._inherited]
        else:
            sockets = [config.bind_socket() for config in configs]
        self._inherited = []
        for sock in sockets:
            sock.set_inheritable(False)  # replicas and builds never hold it
            self._held.append(os.dup(sock.fileno()))
        return sockets

    def on_signal(self, stop: Callable[[], None]) -> None:
        """A restart asked for (SIGUSR2, now or before) stops the servers with ``stop``
        (called in the main thread, where signals are handled)."""
        self._stop = stop
        if self.requested.is_set():
            stop()

    def _signalled(self, signum: int, frame: object) -> None:
        self.requested.set()
        if self._stop is not None:
            self._stop()

    def exec(self, handoff: object) -> NoReturn:
        """Become a new image of this command line with the same sockets and ``handoff``."""
        env = dict(os.environ)
        for fd in self._held:
            os.set_inheritable(fd, True)
        env[LISTEN_ENV] = ",".join(str(fd) for fd in self._held)
        if handoff is not None:
            env[HANDOFF_ENV] = str(_memory_file(json.dumps(handoff).encode()))
        argv = [sys.executable, *sys.orig_argv[1:]]
        logs.event(log, "server.restarting", "restarting in place: the sockets stay open")
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # an ignored signal stays ignored across exec (a handler would not): another
        # SIGUSR2 while the next image loads is dropped, rather than ending the process
        signal.signal(SIGNAL, signal.SIG_IGN)
        try:
            os.execve(sys.executable, argv, env)
        except OSError as exc:
            # nothing runs any more: the next start stops the replicas left and starts them
            logs.event(
                log,
                "server.restart_failed",
                f"cannot re-execute {sys.executable}: {exc}",
                level=logging.ERROR,
            )
            raise SystemExit(1) from None


def _memory_file(data: bytes) -> int:
    fd = os.memfd_create("sless-handoff", 0)  # no MFD_CLOEXEC: the next image reads it
    os.set_inheritable(fd, True)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
