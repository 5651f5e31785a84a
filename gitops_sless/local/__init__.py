"""The local backend: functions built into artifact folders and run as processes.

Owns builds (``builder``, ``installers``, ``depcache``, ``leftovers``), the
sandbox (``sandbox``), the processes (``units``, ``processes``, ``memory``,
``orphans``), their logs (``replica_logs``, ``logfiles``), cron runs
(``scheduler``), secrets from a folder (``secrets``), garbage collection (``gc``)
and the backend itself (``backend``).

May import: ``state``, ``plan``, ``manifests``, ``source`` and the shared top-level
modules; never ``kube`` (backends are independent) nor the HTTP side.
"""

__all__: list[str] = []
