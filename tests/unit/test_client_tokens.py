"""Per-client tokens at rest and in the server's view, and the caller keys they make."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from coderunner.edge import client_tokens
from coderunner.edge.callers import LOCAL_CALLER, caller_key, client_of_key
from coderunner.edge.client_tokens import ClientTokenError, ClientTokens


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return client_tokens.tokens_dir(tmp_path / "token")


def test_add_keeps_only_a_hash_in_a_private_file(folder: Path) -> None:
    token = client_tokens.add(folder, "laptop")
    assert len(token) >= 40
    (entry,) = folder.iterdir()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert entry.name == client_tokens.digest(token) and entry.read_text() == "laptop\n"
    assert client_tokens.names(folder) == ["laptop"]


def test_names_are_checked_and_never_reused_silently(folder: Path) -> None:
    client_tokens.add(folder, "ci")
    with pytest.raises(ClientTokenError, match="already a client"):
        client_tokens.add(folder, "ci")
    for bad in ["default", "local", "http", "Laptop", "a.b", "../x", "-x", "x" * 25, ""]:
        with pytest.raises(ClientTokenError):
            client_tokens.add(folder, bad)
    with pytest.raises(ClientTokenError, match="no client"):
        client_tokens.revoke(folder, "nobody")
    with pytest.raises(ClientTokenError, match="no client"):
        client_tokens.revoke(folder, "../token")


def test_a_folder_others_may_enter_is_refused(folder: Path) -> None:
    client_tokens.add(folder, "ci")
    folder.chmod(0o755)
    with pytest.raises(ClientTokenError, match="chmod 700"):
        client_tokens.names(folder)


def test_links_and_malformed_entries_are_not_tokens(folder: Path, tmp_path: Path) -> None:
    token = client_tokens.add(folder, "ci")
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("mallory\n")
    os.symlink(elsewhere, folder / client_tokens.digest("planted-token"))
    (folder / client_tokens.digest("garbage-token")).write_text("Not A Name")
    (folder / client_tokens.digest("reserved-token")).write_text("default\n")
    assert client_tokens.names(folder) == ["ci"]
    assert client_tokens.lookup(folder, token) == "ci"
    for planted in ("planted-token", "garbage-token", "reserved-token"):
        assert client_tokens.lookup(folder, planted) is None


def test_the_server_view_follows_add_and_revoke_at_once(folder: Path) -> None:
    view = ClientTokens(folder)
    assert view.match("anything") is None  # no folder yet
    token = client_tokens.add(folder, "laptop")
    assert view.match(token) == "laptop"
    assert view.match(token + "x") is None
    other = client_tokens.add(folder, "ci")
    assert view.match(other) == "ci"
    client_tokens.revoke(folder, "laptop")
    assert view.match(token) is None
    assert view.match(other) == "ci"
    folder.chmod(0o755)  # unsafe: every client token is refused until it is fixed
    assert view.match(other) is None
    with pytest.raises(ClientTokenError):
        view.check()


def request(client: str, headers: dict[str, str] | None = None, query: dict[str, str] | None = None) -> object:
    return SimpleNamespace(headers=headers or {}, scope={"coderunner.client": client}, query_params=query or {})


def test_caller_keys_carry_the_token_and_the_header_wins() -> None:
    assert caller_key(None) == LOCAL_CALLER
    assert caller_key(request("default")) == "default/http"
    assert caller_key(request("ci")) == "ci/http"
    assert caller_key(request("ci", {"mcp-session-id": "s1"})) == "ci/mcp:s1"
    assert caller_key(request("ci", query={"session_id": "s1"})) == "ci/sse:s1"
    # Session-per-call clients keep one default session by naming themselves.
    named = {"mcp-session-id": "s1", "x-coderunner-client": "agent"}
    assert caller_key(request("ci", named)) == "ci/client:agent"
    assert caller_key(request("default", named)) == "default/client:agent"
    assert client_of_key("ci/client:agent") == "ci"
    assert client_of_key(LOCAL_CALLER) == LOCAL_CALLER
    # A header cannot put a caller under another token: the key's token part is the scope's.
    assert client_of_key(caller_key(request("ci", {"x-coderunner-client": "default/http"}))) == "ci"


def test_a_new_token_never_begins_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """`coderunner proxy URL --token -abc…` would read the token as an option (seen: a cluster test failed so)."""
    drawn = iter(["-starts-like-an-option", "-again", "fine-token"])
    monkeypatch.setattr(client_tokens.secrets, "token_urlsafe", lambda size: next(drawn))
    assert client_tokens.new_token(32) == "fine-token"
