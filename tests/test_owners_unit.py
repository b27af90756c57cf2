"""Client folder names: stable, readable, one path component, and distinct for distinct clients."""

from __future__ import annotations

from types import SimpleNamespace

from coderunner.owners import ANONYMOUS_HTTP_CLIENT, LOCAL_CLIENT, client_of, folder_name
from coderunner.workspace import NAME


def test_plain_names_stay_readable() -> None:
    assert folder_name("claude-desktop") == "claude-desktop"
    assert folder_name("cursor.2") == "cursor.2"


def test_unsafe_and_reserved_names_get_a_distinct_safe_folder() -> None:
    names = ["../alice", "..", ".", "a/b", "a_b", "local", "http", "-x", "_", "é", "x" * 200, "x" * 201, ""]
    folders = [folder_name(name) for name in names if name]
    assert len(set(folders)) == len(folders), folders
    for folder in folders:
        assert NAME.fullmatch(folder), folder
        assert folder not in (LOCAL_CLIENT, ANONYMOUS_HTTP_CLIENT)


def test_who_is_who() -> None:
    assert client_of(None) == LOCAL_CLIENT
    assert client_of(SimpleNamespace(headers={})) == ANONYMOUS_HTTP_CLIENT
    assert client_of(SimpleNamespace(headers={"x-coderunner-client": "zed"})) == "zed"
    assert client_of(SimpleNamespace(headers={"mcp-session-id": "abc"})) == ANONYMOUS_HTTP_CLIENT
