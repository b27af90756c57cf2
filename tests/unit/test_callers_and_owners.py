"""Who a request is: its caller key (whose default session) and its client's folder (whose files).

Requests are stand-ins with the attributes the code reads (scope, headers, query_params)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from coderunner.edge.auth import CLIENT_SCOPE_KEY
from coderunner.edge.callers import LOCAL_CALLER, MAX_KEY_CHARS, UnknownClient, caller_key, client_of_key, token_client
from coderunner.edge.client_tokens import PRIMARY_CLIENT
from coderunner.edge.owners import (
    ANONYMOUS_HTTP_CLIENT,
    LOCAL_CLIENT,
    MAX_FOLDER_CHARS,
    client_of,
    folder_name,
    token_folder,
)


def request(client: str | None = PRIMARY_CLIENT, headers: dict[str, str] | None = None, **query: str) -> Any:
    scope = {CLIENT_SCOPE_KEY: client} if client is not None else {}
    return SimpleNamespace(scope=scope, headers=headers or {}, query_params=query)


def test_stdio_is_the_local_caller_and_client() -> None:
    assert caller_key(None) == LOCAL_CALLER and token_client(None) == LOCAL_CALLER and client_of(None) == LOCAL_CLIENT


def test_a_request_without_a_checked_token_is_nobody() -> None:
    with pytest.raises(UnknownClient, match="Authorization: Bearer"):
        caller_key(request(client=None))


def test_the_client_header_wins_over_the_mcp_session_which_wins_over_sse() -> None:
    both = request(headers={"x-coderunner-client": "alice", "mcp-session-id": "s1"}, session_id="q")
    assert caller_key(both) == f"{PRIMARY_CLIENT}/client:alice"
    assert caller_key(request(headers={"mcp-session-id": "s1"}, session_id="q")) == f"{PRIMARY_CLIENT}/mcp:s1"
    assert caller_key(request(session_id="q")) == f"{PRIMARY_CLIENT}/sse:q"
    assert caller_key(request()) == f"{PRIMARY_CLIENT}/http"


def test_caller_keys_are_bounded_and_tell_their_token_apart() -> None:
    long = request(client="t1", headers={"x-coderunner-client": "x" * 10_000})
    key = caller_key(long)
    assert key == "t1/client:" + "x" * MAX_KEY_CHARS
    assert client_of_key(key) == "t1" and client_of_key(LOCAL_CALLER) == LOCAL_CALLER


def test_the_primary_tokens_client_is_its_header_or_http() -> None:
    assert client_of(request()) == ANONYMOUS_HTTP_CLIENT
    assert client_of(request(headers={"x-coderunner-client": "alice"})) == "alice"


def test_an_added_tokens_clients_live_under_t_dot_token() -> None:
    assert client_of(request(client="team")) == "t.team"
    assert client_of(request(client="team", headers={"x-coderunner-client": "bob"})) == "t.team.bob"
    assert token_folder("team", None) == "t.team"


@pytest.mark.parametrize("name", ["alice", "ci-runner_2", "a.b"])
def test_a_canonical_name_keeps_its_folder(name: str) -> None:
    assert folder_name(name) == name


@pytest.mark.parametrize("name", ["Alice", "local", "http", "t.evil", "..", "é", "a/b", "x" * 100])
def test_other_names_get_a_safe_hashed_folder(name: str) -> None:
    folder = folder_name(name)
    assert folder != name and len(folder) <= MAX_FOLDER_CHARS
    assert folder[0].isalnum() and not folder.startswith("t.")
    assert set(folder) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-")


def test_names_differing_only_in_case_or_unicode_form_never_share_a_folder() -> None:
    assert len({folder_name("alice"), folder_name("Alice"), folder_name("ALICE")}) == 3
    assert folder_name("caf\u00e9") != folder_name("cafe\u0301")


def test_long_client_names_of_a_token_stay_bounded_and_distinct() -> None:
    first, second = token_folder("team", "n" * 200 + "1"), token_folder("team", "n" * 200 + "2")
    assert first != second and len(first) <= MAX_FOLDER_CHARS and first.startswith("t.team.")
