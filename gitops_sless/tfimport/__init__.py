"""``gitops-sless import terraform``: the sless Terraform provider's resources as a repository.

hcl        read every .tf and tfvars file (python-hcl2's parse tree, with lines)
evaluate   the few expressions an import evaluates: var.*, path.module, jsonencode, ...
variables  variable values: defaults, terraform.tfvars, *.auto.tfvars
refusals   what stops the import before anything is written
convert    resources -> function folders, sless.yaml entries, secrets, problems
write      code, sless.yaml and secret files on disk
migrating  MIGRATING.md: what each resource became and how to retire Terraform
run        the command: all of the above, then validate the output

May import: ``manifests`` (to validate what it writes), ``source`` and the shared
top-level modules.
"""

from __future__ import annotations

from .problems import Problem, Refusal
from .run import ImportReport, import_terraform

__all__ = ["ImportReport", "Problem", "Refusal", "import_terraform"]
