"""What is true now, and what the HTTP side reads: the status store and the tables.

Owns the SQLite status store (``store``) and one environment's records written
through it (``records``), the proxy's routing table (``routes``), what serves and
must start again after a restart (``serving``), every function's phase derived
each pass (``phases``) and the long work under way (``inflight``).

May import: ``plan``, ``manifests``, ``source`` and the shared top-level modules.
Backends and the coordinator write here; the web side reads.
"""
