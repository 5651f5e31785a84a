"""Placeholders are filled in the parsed tree: types kept, values never re-parsed."""

from __future__ import annotations

import pytest
import yaml

from gitops_sless.errors import TemplateError
from gitops_sless.kube import templates
from gitops_sless.kube.templates import OMIT


def _fill(text: str, **values):
    return templates.fill(yaml.safe_load(text), values, "test")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(3, 3, id="int-stays-int"),
        pytest.param(True, True, id="bool-stays-bool"),
        pytest.param({"a": [1, 2]}, {"a": [1, 2]}, id="mapping-stays-mapping"),
        pytest.param("007", "007", id="numeric-string-stays-string"),
        pytest.param("a: b", "a: b", id="yaml-looking-string-stays-string"),
    ],
)
def test_whole_scalar_placeholder_keeps_the_value_type(value, expected):
    assert _fill("x: ${v}", v=value) == {"x": expected}


def test_placeholder_inside_a_string_takes_the_text():
    assert _fill("name: ${a}-cron-${b}", a="fn", b=0) == {"name": "fn-cron-0"}


def test_values_are_not_scanned_again():
    assert _fill("x: ${a}\ny: pre-${a}", a="${b}", b="boom") == {"x": "${b}", "y": "pre-${b}"}


def test_omit_removes_keys_and_items():
    assert _fill("a: ${x}\nb: [1, '${x}', 2]\nc: 3", x=OMIT) == {"b": [1, 2], "c": 3}


def test_missing_placeholder_names_template_and_key():
    with pytest.raises(
        TemplateError, match=r"templates/test.yaml: placeholder \$\{nope\} has no value"
    ):
        _fill("x: ${nope}")


def test_mapping_inside_a_string_is_refused():
    with pytest.raises(TemplateError, match=r"\$\{m\} is inside a string but its value is dict"):
        _fill("x: pre-${m}", m={"a": 1})


def test_filled_value_is_a_copy():
    shared = {"a": 1}
    out = _fill("x: ${m}\ny: ${m}", m=shared)
    out["x"]["a"] = 2
    assert out["y"] == {"a": 1} and shared == {"a": 1}


def test_every_shipped_template_parses_and_names_its_placeholders():
    folder = templates.paths.templates_dir()
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    assert {"namespace", "deployment", "service", "cronjob", "job", "build-job", "pod-spec"} <= set(
        names
    )
    for name in names:
        with pytest.raises(TemplateError, match=rf"templates/{name}.yaml: placeholder"):
            templates.render(name, {})
