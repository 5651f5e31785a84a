"""What an import could not do, each with the file and line it comes from.

A `Refusal` stops the import before anything is written (unparseable HCL, a
reference to a resource nobody declares, ``for_each``): the input is not what
the command understands. A `Problem` is one thing left out (``not converted``,
the command exits 1) or converted with a difference the user should know
(``warning``, exit 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import PermanentError

__all__ = ["NotConvertible", "Problem", "Refusal", "Where"]


@dataclass(frozen=True, order=True)
class Where:
    """A place in the Terraform directory: ``main.tf:12``."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Problem:
    where: Where
    what: str
    why: str
    severity: Literal["not converted", "warning"] = "not converted"

    def __str__(self) -> str:
        label = "not converted" if self.severity == "not converted" else "warning"
        return f"{self.where}: {self.what}: {label}: {self.why}"


class Refusal(PermanentError):
    """The directory cannot be imported as it is: one line per reason."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("\n".join(lines))


class NotConvertible(Exception):
    """Raised while evaluating one value: the caller turns it into a `Problem`."""

    def __init__(self, where: Where, what: str, why: str) -> None:
        self.where, self.what, self.why = where, what, why
        super().__init__(f"{where}: {what}: {why}")
