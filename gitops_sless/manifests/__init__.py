"""What the repository asks for: every ``sless.yaml``, checked and typed.

Owns loading a snapshot's manifests into the desired state (``load``), the JSON
Schema check (``schema``) with YAML positions (``yamldoc``), the reference
generated from the schema (``reference``), the runtimes a function can name
(``runtimes``), cron schedules (``cron``), content-derived build tags
(``identity``) and what a dependency install reads (``dependencies``).

May import: ``source`` and the shared top-level modules.
"""
