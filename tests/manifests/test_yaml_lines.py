"""A YAML syntax error names the line the user must fix, not where PyYAML gave up."""

from __future__ import annotations

import pytest

from gitops_sless.manifests import load as manifest
from gitops_sless.source.snapshot import DirectorySnapshot

M = "fn/sless.yaml"
GOOD = [
    "functions:",  # 1
    "  - name: fn",  # 2
    "    runtime: python3.11",  # 3
    "    entrypoint: handler.main",  # 4
    "    memoryMB: 128",  # 5
    "    env:",  # 6
    "      GREETING: 'hello'",  # 7
    "      TZ: Europe/Paris",  # 8
    "    jobs:",  # 9
    "      - name: fn-setup",  # 10
    "        runId: 1",  # 11
    '        event: {name: "world"}',  # 12
    "    triggers:",  # 13
    "      - type: http",  # 14
    "      - type: cron",  # 15
    "        schedule: '0 2 * * *'",  # 16
]


def broken(line: int, text: str) -> str:
    """The good manifest with line ``line`` (1-based) replaced by ``text``."""
    lines = list(GOOD)
    lines[line - 1] = text
    return "\n".join(lines) + "\n"


def problems_of(write_repo, text: str) -> list[str]:
    root = write_repo({M: text, "fn/handler.py": "def main(event):\n    return event\n"})
    state = manifest.load(DirectorySnapshot(root))
    assert state.functions == {}
    return [str(problem) for problem in state.problems]


CASES = [
    pytest.param(
        broken(12, '        event: {name: "world}'),
        f"{M}:12: (file): YAML syntax error: found unexpected end of stream at the end of the "
        "file, in the quoted string that starts on this line",
        id="unclosed-double-quote-nothing-closes-it",
    ),
    pytest.param(
        broken(7, "      GREETING: 'hello"),
        f"{M}:7: (file): YAML syntax error: expected <block end>, but found '<scalar>' at line "
        "16, after the quoted string that starts on this line and ends on line 16 (is its "
        "closing quote missing?)",
        id="unclosed-single-quote-closed-by-a-later-one",
    ),
    pytest.param(
        broken(7, '      GREETING: "hello'),
        f"{M}:7: (file): YAML syntax error: expected <block end>, but found '<scalar>' at line "
        "12, after the quoted string that starts on this line and ends on line 12 (is its "
        "closing quote missing?)",
        id="unclosed-double-quote-closed-by-a-later-one",
    ),
    pytest.param(
        broken(12, '        event: {name: "world"'),
        f"{M}:12: (file): YAML syntax error: expected ',' or '}}', but got '<scalar>' at line 13, "
        "in the { mapping that starts on this line",
        id="unclosed-brace",
    ),
    pytest.param(
        broken(12, '        event: {names: ["world", "moon"}'),
        f"{M}:12: (file): YAML syntax error: expected ',' or ']', but got '}}', "
        "in the [ list that starts on this line",
        id="unclosed-bracket-inside-braces",
    ),
    pytest.param(
        "\n".join(GOOD) + "\nbogus: [\n",
        f"{M}:17: (file): YAML syntax error: expected the node content, but found '<stream end>' "
        "at the end of the file, in the [ list that starts on this line",
        id="unclosed-bracket-at-the-end",
    ),
    pytest.param(
        broken(8, "     TZ: Europe/Paris"),
        f"{M}:8: (file): YAML syntax error: expected <block end>, but found '<block mapping "
        "start>'",
        id="bad-indentation-less",
    ),
    pytest.param(
        broken(8, "        TZ: Europe/Paris"),
        f"{M}:8: (file): YAML syntax error: expected <block end>, but found '<block mapping "
        "start>'",
        id="bad-indentation-more",
    ),
    pytest.param(
        broken(11, "          runId: 1"),
        f"{M}:11: (file): YAML syntax error: mapping values are not allowed here",
        id="bad-indentation-after-a-plain-value",
    ),
    pytest.param(
        broken(8, "      TZ"),
        f"{M}:8: (file): YAML syntax error: could not find expected ':' at line 9, "
        "in the key that starts on this line",
        id="key-without-colon",
    ),
    pytest.param(
        broken(7, '      GREETING: "C:\\path"'),
        f"{M}:7: (file): YAML syntax error: found unknown escape character 'p', "
        "in the quoted string that starts on this line",
        id="bad-escape",
    ),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_a_yaml_syntax_error_names_the_line_to_fix(write_repo, text: str, expected: str) -> None:
    assert problems_of(write_repo, text) == [expected]


def test_the_good_manifest_loads(write_repo) -> None:
    root = write_repo(
        {M: "\n".join(GOOD) + "\n", "fn/handler.py": "def main(event):\n    return event\n"}
    )
    state = manifest.load(DirectorySnapshot(root))
    assert [str(p) for p in state.problems] == []
    assert sorted(state.functions) == ["fn"]


def test_a_legal_multiline_quoted_string_is_not_blamed_for_a_later_error(write_repo) -> None:
    text = "\n".join([*GOOD[:6], '      GREETING: "two', '        lines"', "      OTHER: [1"])
    assert problems_of(write_repo, text + "\n") == [
        f"{M}:9: (file): YAML syntax error: expected ',' or ']', but got '<stream end>' at the "
        "end of the file, in the [ list that starts on this line"
    ]
