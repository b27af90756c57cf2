"""Tool groups: what a `tools` setting exposes, and how a wrong entry is refused."""

from __future__ import annotations

import itertools

import pytest

from coderunner.policy.tool_groups import ALL, ALWAYS, GROUP_NAMES, ToolsetError, check_selection
from coderunner.tools import declared_groups

#: The groups as the tools declare them (tools/context.py's decorator).
GROUPS = declared_groups()
ALL_TOOLS = GROUPS.all_tools


def test_every_tool_is_in_a_group_and_get_capabilities_in_none() -> None:
    grouped = set(itertools.chain.from_iterable(GROUPS.members(group) for group in GROUP_NAMES))
    always = GROUPS.members(ALWAYS)
    assert always == ("get_capabilities",)
    assert not set(always) & grouped and grouped | set(always) == ALL_TOOLS


def test_only_the_tools_a_group_needs_from_another_are_in_several() -> None:
    shared = {tool: groups for tool, groups in GROUPS.of.items() if len(groups) > 1}
    assert shared == {"manage_jobs": ("python", "oneshot", "jobs"), "manage_sessions": ("python", "sessions")}


def test_a_group_exposes_its_tools_and_get_capabilities() -> None:
    assert GROUPS.selected(["python"]) == {
        "get_capabilities", "run_python", "kernel_reset", "install_packages", "manage_jobs", "manage_sessions",
    }  # fmt: skip


def test_groups_and_single_tools_mix() -> None:
    assert GROUPS.selected(["jobs", "read_file"]) == {"get_capabilities", "manage_jobs", "read_file"}


def test_all_is_every_tool() -> None:
    assert GROUPS.selected([ALL]) == ALL_TOOLS
    assert GROUPS.selected(["python", ALL]) == ALL_TOOLS


def test_entries_are_stripped_and_kept_once_in_order() -> None:
    assert check_selection([" files ", "python", "files", ""]) == ["files", "python"]


def test_an_unknown_entry_is_refused_listing_the_groups() -> None:
    with pytest.raises(ToolsetError, match=r"unknown tool group 'pyhton': use all, python, sessions"):
        check_selection(["pyhton"], ALL_TOOLS)
    # While the settings load (no tools yet) a name is checked in form only; build_server checks the rest.
    assert check_selection(["pyhton"]) == ["pyhton"]
    with pytest.raises(ToolsetError, match=r"unknown tool group 'Python!'"):
        check_selection(["Python!"])


@pytest.mark.parametrize("entries", [[], [""], ["  ", ""]])
def test_choosing_nothing_is_refused(entries: list[str]) -> None:
    with pytest.raises(ToolsetError, match="no tools chosen"):
        GROUPS.selected(entries)
