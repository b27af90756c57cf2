"""Variables a caller hands to code: checked names, values that stay JSON data.

Names become Python or JavaScript globals, or bash environment variables, so each must be a
plain identifier that is not a reserved word, not a dunder, and (for bash) not a variable that
changes how the shell or the dynamic linker behave. Values are never pasted into source: they
travel as one JSON document that the sandbox side parses.

On the MCP surface `variables` is one string holding a JSON object: a free-form object argument is
rejected by google-genai and dropped or closed to `{}` by strict converters (OpenAI, Anthropic,
langchain), while a string survives every one of them, and models write JSON text readily. A list
of {name, value} pairs would need each value JSON-encoded anyway, at a higher schema cost.
"""

from __future__ import annotations

import json
import keyword
import re
from typing import Any

from coderunner.errors import CodeRunnerError

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
MAX_VARIABLES = 256
MAX_JSON_BYTES = 1 << 20
_JS_WORDS = (
    "await break case catch class const continue debugger default delete do else enum export extends false "
    "finally for function if implements import in instanceof interface let new null package private protected "
    "public return static super switch this throw true try typeof var void while with yield arguments eval "
    "undefined NaN Infinity globalThis"
)
JS_RESERVED = frozenset(_JS_WORDS.split())
#: bash variables that change how the shell, its children or the loader run.
_BASH_WORDS = (
    "PATH IFS HOME ENV SHELLOPTS BASHOPTS PS1 PS2 PS3 PS4 PROMPT_COMMAND CDPATH GLOBIGNORE TMPDIR PWD OLDPWD "
    "SHELL UID EUID PPID HOSTNAME LANG LANGUAGE TERM POSIXLY_CORRECT HISTFILE MAIL MAILPATH OPTIND OPTARG"
)
BASH_RESERVED = frozenset(_BASH_WORDS.split())
BASH_RESERVED_PREFIXES = ("BASH", "LD_", "LC_", "PYTHON", "NODE_", "CODERUNNER", "MALLOC_", "GCONV", "NLSPATH")


class VariablesError(CodeRunnerError):
    """A variable cannot be passed as asked; the message names it and says why."""


def parse_variables(text: str | dict[str, Any] | None) -> dict[str, Any]:
    """The JSON object in `text` ('' or '{}': none). An object is taken as it is (lenient clients)."""
    if text is None or isinstance(text, dict):
        return text or {}
    if not isinstance(text, str):
        raise VariablesError(f"variables must be a string holding a JSON object, not {type(text).__name__}")
    if not text.strip():
        return {}
    if len(text) > MAX_JSON_BYTES:
        raise VariablesError(f"variables are {len(text):,} characters; at most {MAX_JSON_BYTES:,} (use a file instead)")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise VariablesError(f'variables is not valid JSON ({exc}); pass an object such as {{"n": 3}}') from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise VariablesError(f'variables must be a JSON object such as {{"n": 3}}, not a JSON {kind}')
    return value


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON data")


def check_variables(variables: dict[str, Any] | None, language: str) -> dict[str, Any]:
    """The variables unchanged when every name is safe for `language` and the whole is JSON data."""
    if not variables:
        return {}
    if not isinstance(variables, dict):
        raise VariablesError("variables must be a JSON object of name: value")
    if len(variables) > MAX_VARIABLES:
        raise VariablesError(f"at most {MAX_VARIABLES} variables per call")
    for name in variables:
        problem = _name_problem(name, language)
        if problem:
            raise VariablesError(f"variable name {name!r} {problem}")
    try:
        size = len(json.dumps(variables, allow_nan=False).encode())
    except (TypeError, ValueError) as exc:
        raise VariablesError(f"variables must be plain JSON values: {exc}") from None
    if size > MAX_JSON_BYTES:
        raise VariablesError(f"variables are {size:,} bytes as JSON; at most {MAX_JSON_BYTES:,} (use a file instead)")
    return variables


def _name_problem(name: str, language: str) -> str | None:
    if not isinstance(name, str) or not IDENTIFIER.match(name):
        return "is not an identifier: use letters, digits and _, not starting with a digit (at most 64)"
    if name.startswith("__"):
        return "starts with '__': dunder and private names are refused"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in JS_RESERVED:
        return "is a reserved word"
    if language == "bash" and (name in BASH_RESERVED or name.upper().startswith(BASH_RESERVED_PREFIXES)):
        return "would change how bash or the programs it starts run; choose another name"
    return None
