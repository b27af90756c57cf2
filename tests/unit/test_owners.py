"""Client folder names: stable, readable, one path component, and distinct for distinct clients."""

from __future__ import annotations

import unicodedata
from types import SimpleNamespace

import pytest

from coderunner.edge.callers import UnknownClient
from coderunner.edge.owners import ANONYMOUS_HTTP_CLIENT, LOCAL_CLIENT, client_of, folder_name
from coderunner.hostfs.exports import CLIENT_FOLDER
from coderunner.hostfs.workspaces import NAME


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


def request(client: str = "default", **headers: str) -> SimpleNamespace:
    """A request as RequireToken passes it on: the token's client in the scope."""
    return SimpleNamespace(headers=headers, scope={"coderunner.client": client}, query_params={})


def test_who_is_who() -> None:
    assert client_of(None) == LOCAL_CLIENT
    assert client_of(request()) == ANONYMOUS_HTTP_CLIENT
    assert client_of(request(**{"x-coderunner-client": "zed"})) == "zed"
    assert client_of(request(**{"mcp-session-id": "abc"})) == ANONYMOUS_HTTP_CLIENT


def test_an_added_tokens_clients_have_folders_of_their_own() -> None:
    assert client_of(request("laptop")) == "t.laptop"
    assert client_of(request("laptop", **{"x-coderunner-client": "zed"})) == "t.laptop.zed"
    assert client_of(request("ci", **{"x-coderunner-client": "zed"})) == "t.ci.zed"
    long = client_of(request("a" * 24, **{"x-coderunner-client": "z" * 200}))
    assert NAME.fullmatch(long) and long.startswith("t." + "a" * 24 + ".")


def test_no_name_of_the_servers_own_token_reaches_an_added_tokens_folder() -> None:
    """The server's own token may send any header: none may land in another token's folder."""
    for name in ["t.laptop", "t.laptop.zed", "t.", "T.laptop", "t.ci", "t"]:
        folder = client_of(request(**{"x-coderunner-client": name}))
        assert not folder.startswith("t."), (name, folder)
        assert NAME.fullmatch(folder)


def test_a_request_that_passed_no_token_check_is_nobody() -> None:
    with pytest.raises(UnknownClient):
        client_of(SimpleNamespace(headers={"x-coderunner-client": "zed"}, scope={}))


def casefold_nfkc(folder: str) -> str:
    return unicodedata.normalize("NFKC", folder).casefold()


def test_names_differing_only_in_case_or_unicode_form_never_share_a_folder() -> None:
    """`T.alice` beside `t.alice` is one folder on macOS: every folder name is lowercase ASCII."""
    names = ["alice", "Alice", "ALICE", "t.alice", "T.alice", "T.Alice", "é", "e\u0301", "\u212a", "k", "K",
             "Local", "HTTP", "ﬁle", "file", "ǅ", "dž", "Straße", "strasse", "İ", "i"]  # fmt: skip
    requests = [request(**{"x-coderunner-client": name}) for name in names]
    requests += [request("laptop", **{"x-coderunner-client": name}) for name in names]
    folders = [client_of(r) for r in requests]
    assert len({casefold_nfkc(f) for f in folders}) == len(folders), folders
    for folder in folders:
        assert folder == casefold_nfkc(folder) and folder.isascii() and CLIENT_FOLDER.fullmatch(folder), folder
    assert client_of(request(**{"x-coderunner-client": "T.alice"})) != "t.alice"


def test_canonical_names_keep_their_folders() -> None:
    """Existing lowercase folders stay found; only names with capitals or other characters move."""
    for name in ["claude-desktop", "cursor.2", "zed", "a_b.c-d"]:
        assert folder_name(name) == name
    assert client_of(request("laptop", **{"x-coderunner-client": "zed"})) == "t.laptop.zed"
    moved = folder_name("Claude-Desktop")
    assert moved.startswith("claude-desktop-") and moved != folder_name("claude-desktop")
