"""Argument types shared by several tools, defined once so their schemas cannot drift apart.

Optional text arguments are plain strings where '' means "not given": no null to wrap, and a strict-mode
model (which must send every argument) has an obvious value to send. session_id is explained once, in
create_session's description and the server instructions, not in every tool.
"""

# No `from __future__ import annotations`: the SDK reads these types at runtime.

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from coderunner.config import MIN_MEMORY_MB
from coderunner.vocabulary.network import NetworkCeilingError, check_within, modes_within


def _none_as_empty(value: Any) -> Any:
    """A client that sends null for an optional text argument means "not given", as '' does."""
    return "" if value is None else value


#: Optional text: '' (or null, from lenient clients) means "not given".
Text = Annotated[str, BeforeValidator(_none_as_empty)]


def _numbers_as_pages(value: Any) -> Any:
    """A page number (2) or a list of them ([1, 3]) is what '2' or '1,3' says: models send either."""
    numbers = value if isinstance(value, list) and value else [value]
    if all(isinstance(item, int) and not isinstance(item, bool) for item in numbers):
        return ",".join(str(item) for item in numbers)
    return _none_as_empty(value)


#: Pages of a document as text like '1-3,5'; a whole number or a list of them is taken too (the schema stays text).
Pages = Annotated[str, BeforeValidator(_numbers_as_pages), Field(description="e.g. 1-3,5")]


def page_ranges(value: Any) -> Any:
    """Ranges of pages ('1-2,3-': one part each) in the string form `pages` has; a list of them, as
    ['1-2', '3-'] or [1, 2], is what its parts joined by commas say."""
    if isinstance(value, list) and all(isinstance(item, str | int) and not isinstance(item, bool) for item in value):
        return ",".join(str(item) for item in value)
    return _none_as_empty(value)


def _object_as_text(value: Any) -> Any:
    """A client that still sends an object for `variables` is served: it becomes the JSON text."""
    return json.dumps(value) if isinstance(value, dict) else _none_as_empty(value)


VariablesArg = Annotated[
    str,
    BeforeValidator(_object_as_text),
    Field(description="JSON object; keys become variables."),
]
LanguageArg = Literal["python", "javascript", "bash"]


#: What each mode above none means, for the argument's description.
_MODE_MEANS = {"allowlist": "allowlist: only the user's allowed_domains", "internet": "internet: anywhere"}


def network_arg(ceiling: str) -> Any:
    """A `network` argument offering only the modes within the user's ceiling (vocabulary/network.py).

    A mode above it is refused with the ceiling's own message (ask the user), before the enum check.
    """
    modes = modes_within(ceiling)
    description = "; ".join(_MODE_MEANS[mode] for mode in modes if mode in _MODE_MEANS) + "." if modes[1:] else None

    def within(value: Any) -> Any:
        if isinstance(value, str):
            try:
                check_within(value, ceiling)
            except NetworkCeilingError as exc:
                raise ValueError(str(exc)) from None
        return value

    def enum(schema: dict[str, Any]) -> None:
        schema.pop("const", None)  # one mode: an enum still, which every function-calling API reads
        schema["enum"] = list(modes)

    return Annotated[
        Literal[modes],
        BeforeValidator(within),
        Field(description=description, json_schema_extra=enum),
    ]


MemoryMb = Annotated[int, Field(ge=MIN_MEMORY_MB)]
SessionId = Text
Seconds = Annotated[float | None, Field(ge=1)]
#: A page wait in the browser tools.
BrowserSeconds = Annotated[float | None, Field(ge=1, le=300)]
#: Optional path of an output file, for the guest tools.
OutputPath = Text
#: When a run answers with a job id instead of waiting for its end (None: the detach_after_s setting).
DetachAfter = Annotated[
    float | None,
    Field(ge=0, description="Then answer with a job id (0: at once)."),
]
