"""Where a push comes in: the repository and what it holds, before anything is parsed.

Owns following the remote (``mirror``, its deadline-bound child ``fetcher`` and
``known_hosts``), immutable snapshots of a commit's files (``snapshot``), turning a
plain folder into a repository to follow (``seed``), and reading forges' webhook
payloads (``webhooks``: signatures and pushes, no I/O).

May import: the shared top-level modules (errors, logs, redact, ...). Nothing above.
"""
