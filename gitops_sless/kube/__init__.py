"""The Kubernetes backend.

Owns talking to the API server (``client``, ``contexts``, ``credentials``,
``connect``), the watch-fed view of a cluster (``informer``, ``view``), builds with
kaniko (``builds``, ``registry``, ``storage``), the objects of an environment
(``renderer`` from ``templates``, ``netpolicy``, ``gateway``) applied and pruned
(``apply``), jobs and cron runs (``jobs``, ``runs``, ``cronruns``), the Function
resources' status (``functions``, ``status``), leader election (``leader``),
garbage collection (``gc``) and the backend itself (``backend``).

May import: ``state``, ``plan``, ``manifests``, ``source`` and the shared top-level
modules; never ``local`` (backends are independent) nor the HTTP side.
"""
