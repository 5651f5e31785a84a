"""MIGRATING.md: every resource and what it became, the secrets, and how to retire Terraform."""

from __future__ import annotations

from .convert import Conversion, Secret

__all__ = ["migrating", "secret_instructions"]

ENV_NAMESPACE = "sless-prod"  # the namespace of the prod environment on Kubernetes


def secret_instructions(secrets: list[Secret], secrets_dir: str | None) -> list[str]:
    """How to create each secret, by file (serve) and by kubectl; never the value itself."""
    lines: list[str] = []
    where = secrets_dir or "secrets"
    for s in secrets:
        lines.append(f"- `{s.secret}/{s.key}`: the value of {s.origin}")
    if not secrets:
        return lines
    if secrets_dir is None:
        lines += [
            "",
            "Create one file per key (the value alone; a trailing newline is dropped):",
            "",
        ]
        lines += ["```sh"]
        for s in secrets:
            lines.append(
                f'mkdir -p {where}/{s.secret} && printf %s "$VALUE" > {where}/{s.secret}/{s.key}'
            )
        lines += ["```"]
    else:
        lines += [
            "",
            f"They were written to `{where}/SECRET/KEY` (mode 0600), outside the repository.",
        ]
    lines += [
        "",
        f"then `gitops-sless serve --secrets-dir {where} ...`; on Kubernetes:",
        "",
        "```sh",
    ]
    for name in sorted({s.secret for s in secrets}):
        keys = " ".join(
            f"--from-file={s.key}={where}/{s.secret}/{s.key}" for s in secrets if s.secret == name
        )
        lines.append(f"kubectl create secret generic {name} -n {ENV_NAMESPACE} {keys}")
    lines += ["```"]
    return lines


def migrating(conversion: Conversion, source: str, secrets_dir: str | None) -> str:
    lines = [
        "# Migrating from the sless Terraform provider",
        "",
        f"Written by `gitops-sless import terraform {source}`. Check it with "
        "`gitops-sless validate .`, commit it, and serve it.",
        "",
        "## What each resource became",
        "",
        "| resource | where | became |",
        "|---|---|---|",
    ]
    for o in conversion.outcomes:
        lines.append(f"| `{o.address}` | {o.where} | {o.became} |")
    lines += ["", "## Not converted, and warnings", ""]
    lines += [f"- {p}" for p in conversion.problems] or ["None: everything was converted."]
    lines += ["", "## Secrets", ""]
    if conversion.secrets:
        lines += [
            "Values from sensitive variables, and env values whose name looks like a password, "
            "DSN, token or key, are `{secret: NAME, key: KEY}` references; their values are not "
            "in this repository:",
            "",
            *secret_instructions(conversion.secrets, secrets_dir),
        ]
    else:
        lines.append("None.")
    lines += ["", *_retire(conversion)]
    return "\n".join(lines) + "\n"


def _retire(conversion: Conversion) -> list[str]:
    converted = [o for o in conversion.outcomes if o.converted and o.address.startswith("sless_")]
    order = ("sless_job.", "sless_trigger.", "sless_function.")
    ordered = [o.address for prefix in order for o in converted if o.address.startswith(prefix)]
    lines = [
        "## Retiring the Terraform objects without downtime",
        "",
        "1. Serve this repository (`git init && git add -A && git commit -m import`, push it "
        "where `gitops-sless serve --repo` follows it). The old functions keep running meanwhile: "
        "both answer at once. Jobs with `runId` > 0 run once here too; set a job's `runId: 0` "
        "beforehand only if nothing takes its result and it must not run twice.",
        "2. Check that every function is Ready (`gitops-sless status`), then switch callers "
        "from the operator's `/fn/{namespace}/NAME` to `/fn/prod/NAME`.",
        "3. Forget the old objects in Terraform's state, so no later `terraform apply` or "
        "`destroy` touches them (jobs, then triggers, then functions):",
        "",
        "```sh",
        *[f"terraform state rm '{address}'" for address in ordered],
        "```",
        "",
        "4. Once no traffic reaches them, delete the old objects in the operator.",
        "",
        "Why this order: `terraform state rm` deletes nothing, so the old functions answer "
        "until the new ones are serving and traffic has moved, and a rollback is one DNS or "
        "proxy change. Running `terraform destroy` first would take the functions down "
        "before their replacements serve. If you would rather destroy than delete by hand, "
        "do it only after step 2, in the same order (`terraform destroy -target=...` jobs, "
        "then triggers, then functions): a trigger or job left behind a deleted function "
        "would fire at nothing.",
    ]
    return lines
