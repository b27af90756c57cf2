"""parse_variables: the JSON-object text run_python and execute_code take, and what it says when it is not one."""

from __future__ import annotations

import pytest

from coderunner.policy.call_variables import MAX_JSON_BYTES, VariablesError, parse_variables


@pytest.mark.parametrize("empty", ["", "  ", "{}", None, {}])
def test_nothing_given_is_no_variables(empty: object) -> None:
    assert parse_variables(empty) == {}  # type: ignore[arg-type]


def test_an_object_in_text_or_as_is_comes_back_as_data() -> None:
    assert parse_variables('{"n": 3, "t": [1, null, "x"]}') == {"n": 3, "t": [1, None, "x"]}
    assert parse_variables({"n": 3}) == {"n": 3}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[1, 2]", "not a JSON array"),
        ('"n"', "not a JSON string"),
        ("3", "not a JSON number"),
        ("{n: 3}", "is not valid JSON"),
        ('{"n": NaN}', "NaN is not JSON data"),
        ('{"n": Infinity}', "Infinity is not JSON data"),
        ("[" * 100_000, "is not valid JSON"),
    ],
)
def test_anything_else_is_refused_saying_what_to_send(text: str, said: str) -> None:
    with pytest.raises(VariablesError, match="variables") as raised:
        parse_variables(text)
    assert said in str(raised.value) and "Traceback" not in str(raised.value)


def test_oversized_text_is_refused_before_parsing() -> None:
    with pytest.raises(VariablesError, match="use a file instead"):
        parse_variables('{"a": "' + "x" * MAX_JSON_BYTES + '"}')
