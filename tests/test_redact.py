"""Passwords of URLs in what installers and git print: masked, in linear time.

The masker used to be a plain regex that Python's backtracking engine tries at
every position: on one long line of letters (``npm`` printing a minified
file, or a preinstall script printing megabytes on purpose) it rescanned the
run from every position, quadratic work that held the GIL and froze the whole
reconciler. These tests feed it what an attacker would and check the result,
not the time: the old pattern never finishes the multi-MiB cases.
"""

from __future__ import annotations

import random
import re
import re._constants as sre_constants
import re._parser as sre_parse

import pytest

from gitops_sless import redact
from gitops_sless.local.installers import BuildLog
from gitops_sless.redact import url_passwords

MiB = 1 << 20

# what the masker replaced: the plain pattern, used as the reference of what is masked
REFERENCE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):[^/\s@]*@")


def reference(text: str, mask: str = "****") -> str:
    return REFERENCE.sub(lambda m: f"{m[1]}:{mask}@", text)


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        pytest.param("https://user:pass@host/", "https://user:****@host/", id="https"),
        pytest.param(
            "Looking in indexes: https://bob:s3cr3t@pypi.example/simple",
            "Looking in indexes: https://bob:****@pypi.example/simple",
            id="in-a-line",
        ),
        pytest.param("https://:tok@host/r", "https://:****@host/r", id="token-only"),
        pytest.param("git+ssh://a:b@h/x a:c@d", "git+ssh://a:****@h/x a:c@d", id="scheme-chars"),
        pytest.param("12ab://u:p@h", "12ab://u:****@h", id="scheme-after-digits"),
        pytest.param("x https://u:p@h y http://v:q@i", "x https://u:****@h y http://v:****@i"),
        pytest.param("ssh://git@host/r.git", "ssh://git@host/r.git", id="user-only"),
        pytest.param("https://host/path:x@y", "https://host/path:x@y", id="no-userinfo"),
        pytest.param("a://a" * 1000, "a://a" * 1000, id="no-password"),
    ],
)
def test_passwords_in_urls_are_masked(text, masked):
    assert url_passwords(text, "****") == masked
    assert reference(text) == masked


def test_it_masks_exactly_what_the_plain_pattern_masked():
    rnd = random.Random(32)
    pieces = ["a", "Z", "1", "+", ".", "-", ":", "/", "@", " ", "\n", "://", "u:p@", "_", "é"]
    for _ in range(50_000):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(0, 24)))
        assert url_passwords(text, "****") == reference(text), repr(text)


def _repeats(node: object) -> list[str]:
    """The names of every repeat opcode in a parsed pattern."""
    found = []
    for op, arg in node:  # type: ignore[attr-defined]
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            found.append(str(op))
        if op is sre_constants.POSSESSIVE_REPEAT:
            found.append("POSSESSIVE_REPEAT")
        for sub in arg if isinstance(arg, (list, tuple)) else []:
            if isinstance(sub, sre_parse.SubPattern):
                found += _repeats(sub)
            elif isinstance(sub, (list, tuple)):
                found += [
                    r
                    for item in sub
                    if isinstance(item, sre_parse.SubPattern)
                    for r in _repeats(item)
                ]
    return found


def test_the_pattern_cannot_backtrack_by_construction():
    """Every quantifier is possessive (gives nothing back) and a scheme is tried only
    where a run of scheme characters starts (the lookbehind comes first)."""
    parsed = sre_parse.parse(redact._URL_PASSWORD.pattern)
    repeats = _repeats(parsed)
    assert repeats and set(repeats) == {"POSSESSIVE_REPEAT"}, repeats
    assert parsed[0][0] is sre_constants.ASSERT_NOT  # the lookbehind, before any repeat


LONG_LINES = [
    # a run of scheme characters, then "://": the plain pattern rescans the run per position
    pytest.param("a" * (4 * MiB) + "://", "a" * (4 * MiB) + "://", id="letters"),
    pytest.param("9999-99-99T" * (MiB // 2) + "://h", "9999-99-99T" * (MiB // 2) + "://h"),
    pytest.param(
        "x://h:" + "p" * (4 * MiB) + " https://u:pw@h/",
        "x://h:" + "p" * (4 * MiB) + " https://u:****@h/",
        id="long-password-without-at",
    ),
    pytest.param("a://a" * (MiB * 4 // 5), "a://a" * (MiB * 4 // 5), id="a-scheme-every-5"),
    pytest.param(
        "a://h:p@" * (MiB // 2), "a://h:****@" * (MiB // 2), id="half-a-million-passwords"
    ),
]


@pytest.mark.parametrize(("text", "masked"), LONG_LINES)
def test_a_line_of_megabytes_is_masked_whole(text, masked):
    assert url_passwords(text, "****") == masked


def test_the_build_log_scrubs_a_line_of_megabytes(tmp_path):
    log = BuildLog(tmp_path / "build.log", ["hunter2-secret"])
    line = "a" * (4 * MiB) + " hunter2-secret https://bob:pw@index.example/ a://x\n"
    log.write(line)
    text = log.text()
    assert text.endswith(" **** https://bob:****@index.example/ a://x\n")
    assert len(text) == 4 * MiB + len(" **** https://bob:****@index.example/ a://x\n")
