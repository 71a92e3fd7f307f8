"""Template values reach the program as literal text, whatever they contain and wherever
the placeholder sits — checked against a real /bin/sh."""

from __future__ import annotations

import re
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.pipeline.shellquote import substitute

PLACEHOLDER = re.compile(r"\{\{(.*?)\}\}")
# Each template prints the argument(s) the program gets, NUL-separated.
TEMPLATES = [
    ("printf '%s\\0' {{V}}", "{v}"),
    ("printf '%s\\0' \"{{V}}\"", "{v}"),
    ("printf '%s\\0' '{{V}}'", "{v}"),
    ("printf '%s\\0' --in={{V}}", "--in={v}"),
    ("printf '%s\\0' \"pre {{V}} post\"", "pre {v} post"),
    ("printf '%s\\0' 'a'{{V}}\"b\"", "a{v}b"),
    ("printf '%s\\0' \"$(printf '%s' {{V}})\"", "{v}"),
    ("printf '%s\\0' \"`printf '%s' {{V}}`\"", "{v}"),
    ("x=$(printf '%s' \"{{V}}\"); printf '%s\\0' \"$x\"", "{v}"),
]
HOSTILE = ["x; touch /tmp/m27-pwned", "$(id)", "`id`", "a b", "'", '"', "\\", "$HOME",
           "\\'\"$(`", "*", "-n", "", "\n", "a\nb", "${IFS}", "'; echo pwned; '"]


def run(command: str) -> list[str]:
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, check=True,
                         timeout=10).stdout
    return out.decode("utf-8", "surrogateescape").split("\0")[:-1]


def fill(template: str, value: str) -> str:
    return substitute(template, PLACEHOLDER, lambda _m: value)


@pytest.mark.parametrize(("template", "expected"), TEMPLATES)
@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_are_just_text(template: str, expected: str, value: str) -> None:
    # Command substitution drops trailing newlines: that is the shell, not the quoting.
    substituted = "$(" in template or "`" in template
    value_seen = value.rstrip("\n") if substituted else value
    assert run(fill(template, value)) == [expected.format(v=value_seen)]


@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
               max_size=40))
def test_any_value_round_trips_in_every_plain_context(value: str) -> None:
    for template, expected in TEMPLATES[:6]:
        assert run(fill(template, value)) == [expected.format(v=value)]


def test_unknown_placeholders_are_left_alone() -> None:
    assert substitute("echo {{A}} {{B}}", PLACEHOLDER,
                      lambda m: "x" if m.group(1) == "A" else None) == "echo x {{B}}"
