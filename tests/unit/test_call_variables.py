"""Variables a caller hands to code: which names each language may get, and what JSON is accepted."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coderunner.policy.call_variables import (
    MAX_JSON_BYTES,
    MAX_VARIABLES,
    VariablesError,
    check_variables,
    parse_variables,
)


@pytest.mark.parametrize("name", ["n", "_private", "data2", "A" * 64, "PATH", "LD_PRELOAD"])
def test_plain_identifiers_are_python_names(name: str) -> None:
    assert check_variables({name: 1}, "python") == {name: 1}


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("2x", "is not an identifier"),
        ("a-b", "is not an identifier"),
        ("", "is not an identifier"),
        ("A" * 65, "is not an identifier"),
        ("__import__", "starts with '__'"),
        ("class", "is a reserved word"),
        ("match", "is a reserved word"),  # a soft keyword
        ("typeof", "is a reserved word"),  # JavaScript's
    ],
)
def test_unsafe_names_are_refused_with_the_reason(name: str, problem: str) -> None:
    with pytest.raises(VariablesError, match=problem):
        check_variables({name: 1}, "python")


@pytest.mark.parametrize("name", ["PATH", "IFS", "LD_PRELOAD", "BASH_ENV", "lc_all", "PYTHONPATH", "CODERUNNER_X"])
def test_bash_refuses_names_that_change_how_the_shell_runs(name: str) -> None:
    with pytest.raises(VariablesError, match="would change how bash"):
        check_variables({name: "x"}, "bash")
    assert check_variables({name: "x"}, "python") == {name: "x"}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {1, 2}, b"bytes", object()])
def test_values_must_be_plain_json(value: Any) -> None:
    with pytest.raises(VariablesError, match="plain JSON values"):
        check_variables({"v": value}, "python")


def test_too_many_or_too_big_is_refused() -> None:
    with pytest.raises(VariablesError, match=f"at most {MAX_VARIABLES} variables"):
        check_variables({f"v{i}": i for i in range(MAX_VARIABLES + 1)}, "python")
    with pytest.raises(VariablesError, match="use a file instead"):
        check_variables({"big": "x" * MAX_JSON_BYTES}, "python")
    assert check_variables(None, "python") == {} and check_variables({}, "bash") == {}


@pytest.mark.parametrize("text", [None, "", "   ", "{}"])
def test_no_variables_is_an_empty_object(text: str | None) -> None:
    assert parse_variables(text) == {}


def test_a_json_object_is_parsed_and_an_object_taken_as_it_is() -> None:
    assert parse_variables('{"n": 3, "xs": [1, 2]}') == {"n": 3, "xs": [1, 2]}
    given = {"n": 3}
    assert parse_variables(given) is given


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1, 2]", "not a JSON array"),
        ('"text"', "not a JSON string"),
        ("3", "not a JSON number"),
        ("null", "not a JSON null"),
        ("{n: 3}", "not valid JSON"),
        ('{"n": NaN}', "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_anything_but_a_json_object_is_refused_with_an_example(text: str, problem: str) -> None:
    with pytest.raises(VariablesError, match=problem):
        parse_variables(text)


def test_a_non_string_or_an_oversized_text_is_refused() -> None:
    with pytest.raises(VariablesError, match="not list"):
        parse_variables([1])  # type: ignore[arg-type]
    with pytest.raises(VariablesError, match="use a file instead"):
        parse_variables(json.dumps({"x": "y" * MAX_JSON_BYTES}))
