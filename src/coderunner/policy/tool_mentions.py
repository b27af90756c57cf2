"""A reply never names a tool the `tools` setting leaves out: a model would call it and be refused.

Replies are written in many layers (a session's limits, the network ceiling, the snapshot store) that
do not know which tools this server offers. The tools name each other freely there; at the edge of
every call (tools/context.py) a mention of a tool that is not offered becomes what the user can do
instead: turn on the group that has it. A call written out, `create_session(network=...)`, goes whole.
Texts the tool layer composes itself name a tool only when it is offered (see `Mentions.offers`).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from coderunner.policy.tool_groups import ALWAYS, ToolGroups

#: A tool's call as replies write it out, e.g. create_session(network='allowlist', allow=['x']): its
#: arguments name what the tool takes. A remark in brackets (with no `=`) stays.
_CALL = r"(?:\([^()=]*=[^()]*\))?"


@dataclass(frozen=True)
class Mentions:
    """The tools a server offers, and how a reply says the others are not."""

    offered: frozenset[str]
    groups: ToolGroups
    _pattern: re.Pattern[str] | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        hidden = sorted(self.groups.all_tools - self.offered, key=len, reverse=True)
        if hidden:
            names = "|".join(re.escape(name) for name in hidden)
            object.__setattr__(self, "_pattern", re.compile(rf"\b({names})\b{_CALL}"))

    def offers(self, tool: str) -> bool:
        return tool in self.offered

    def missing(self, tool: str) -> str:
        """What to say of a tool that is not offered: the group(s) the user would turn on to get it."""
        groups = [group for group in self.groups.of.get(tool, ()) if group != ALWAYS]
        named = " or ".join(repr(group) for group in groups) or "its tool"
        return f"a tool not offered here (the user can add {named} to the tools setting)"

    def text(self, text: str) -> str:
        """`text` with every mention of a tool that is not offered replaced by what the user can do."""
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda match: self.missing(match.group(1)), text)

    def value(self, value: Any) -> Any:
        """A reply's structured content, its strings rewritten as `text` does (dicts and lists walked)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        return value


def names_in(text: str, tools: Collection[str]) -> set[str]:
    """The tools of `tools` that `text` names (as whole words)."""
    return {tool for tool in tools if re.search(rf"\b{re.escape(tool)}\b", text)}
