"""Input variables: declared defaults, then ``terraform.tfvars``, then ``*.auto.tfvars``.

That is Terraform's own precedence (``-var`` and ``TF_VAR_*`` are not read: an
import is reproducible from the directory alone).
"""

from __future__ import annotations

from .evaluate import Evaluator, Variable
from .hcl import Module
from .problems import NotConvertible, Problem

__all__ = ["load_variables"]


def load_variables(module: Module, problems: list[Problem]) -> dict[str, Variable]:
    """Every declared variable with its value; a value that cannot be read is a problem."""
    literal = Evaluator(module, {})  # defaults and tfvars may not reference anything
    variables: dict[str, Variable] = {}
    for block in module.blocks:
        if block.type != "variable" or len(block.labels) != 1:
            continue
        name = block.labels[0]
        sensitive = _flag(literal, block.attributes.get("sensitive"), problems)
        default = block.attributes.get("default")
        value, has_value = None, False
        if default is not None:
            value, has_value = _read(literal, default, problems)
        where = default.where if default is not None else block.where
        variables[name] = Variable(name, value, sensitive, where, has_value)
    for attribute in module.tfvars:
        declared = variables.get(attribute.name)
        if declared is None:
            continue  # Terraform only warns about a value for an undeclared variable
        value, has_value = _read(literal, attribute, problems)
        if has_value:
            variables[attribute.name] = Variable(
                attribute.name, value, declared.sensitive, attribute.where
            )
    return variables


def _read(literal: Evaluator, attribute, problems: list[Problem]) -> tuple[object, bool]:
    try:
        return literal.attribute(attribute).data, True
    except NotConvertible as exc:
        problems.append(Problem(exc.where, exc.what, exc.why))
        return None, False


def _flag(literal: Evaluator, attribute, problems: list[Problem]) -> bool:
    if attribute is None:
        return False
    value, _ = _read(literal, attribute, problems)
    return value is True
