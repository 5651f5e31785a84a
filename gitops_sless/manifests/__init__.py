"""What the repository asks for: every ``sless.yaml``, checked and typed.

Owns loading a snapshot's manifests into the desired state (``load``), the JSON
Schema check (``schema``) with YAML positions (``yamldoc``), the reference
generated from the schema (``reference``), the runtimes a function can name
(``runtimes``), cron schedules (``cron``), what triggers say and the checks the
schema cannot make (``triggers``), content-derived build tags
(``identity``) and what a dependency install reads (``dependencies``).

May import: ``source`` and the shared top-level modules.
"""
