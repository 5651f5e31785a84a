"""``gitops-sless import terraform``: read, refuse or convert, write, validate, report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SourceError
from ..manifests import load as manifest
from ..source.snapshot import open_source
from .convert import Conversion, convert
from .hcl import read_module
from .migrating import migrating, secret_instructions
from .problems import Refusal
from .refusals import refusals
from .write import copy_code, write_manifest, write_secrets

__all__ = ["ImportReport", "import_terraform"]

_HEADER = "# Imported by gitops-sless import terraform from {source}: see MIGRATING.md\n"


@dataclass
class ImportReport:
    """What the command prints and returns."""

    lines: list[str] = field(default_factory=list)
    written: bool = False
    complete: bool = True


def import_terraform(
    directory: Path, out: Path, *, secrets_dir: Path | None = None, force: bool = False
) -> ImportReport:
    """Raises `Refusal` (nothing written unless ``force``) or `SourceError` (bad paths)."""
    if not directory.is_dir():
        raise SourceError(f"{directory}: not a directory")
    if not any(directory.glob("*.tf")):
        raise SourceError(f"{directory}: no *.tf files")
    if out.exists() and any(out.iterdir()) and not force:
        raise SourceError(f"--out {out}: not empty; choose a new folder or pass --force")
    report = ImportReport()
    module = read_module(directory.resolve())  # path.module is absolute from here on
    refused = module.unparsed + refusals(module)
    if refused and not force:
        raise Refusal(refused)
    conversion = convert(module)
    _write(conversion, directory, out, secrets_dir, report)
    report.lines = refused + [str(p) for p in conversion.problems] + report.lines
    report.complete = conversion.complete and not refused and report.complete
    return report


def _write(
    conversion: Conversion,
    directory: Path,
    out: Path,
    secrets_dir: Path | None,
    report: ImportReport,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header = _HEADER.format(source=directory.name)
    for folder in conversion.folders:
        for left in copy_code(folder, out):
            report.lines.append(f"{folder.path}/{left}: a link out of source_dir; not copied")
        write_manifest(folder, out, header)
    if secrets_dir is not None and conversion.secrets:
        write_secrets(conversion.secrets, secrets_dir)
    text = migrating(conversion, directory.name, str(secrets_dir) if secrets_dir else None)
    (out / "MIGRATING.md").write_text(text, encoding="utf-8")
    report.written = True
    _validate(out, report)
    _summary(conversion, out, secrets_dir, report)


def _validate(out: Path, report: ImportReport) -> None:
    """The output must be what ``validate`` accepts: say so when it is not."""
    state = manifest.load(open_source(out))
    for problem in state.problems:
        report.lines.append(f"{out}/{problem}")
        report.complete = False


def _summary(
    conversion: Conversion, out: Path, secrets_dir: Path | None, report: ImportReport
) -> None:
    functions = sum(len(f.functions) for f in conversion.folders)
    jobs = sum(len(fn.get("jobs", [])) for f in conversion.folders for fn in f.functions)
    report.lines.append(
        f"wrote {functions} functions and {jobs} jobs in {len(conversion.folders)} folders "
        f"to {out} (see {out / 'MIGRATING.md'})"
    )
    if conversion.secrets and secrets_dir is None:
        report.lines.append("secrets are not in the repository; create them before serving:")
        lines = secret_instructions(conversion.secrets, None)
        report.lines += ["  " + line for line in lines if line and not line.startswith("```")]
    elif conversion.secrets:
        report.lines.append(f"wrote {len(conversion.secrets)} secret values to {secrets_dir}")
