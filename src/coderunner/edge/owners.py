"""Which client owns what a session leaves behind: its exported files and its persistent names.

The caller keys of callers.py pick a default session and can be per connection; ownership must
outlive a connection, so it is keyed on a stable client name instead, one folder name each:
- stdio (and the CLI): `local`, the one user of that server;
- the server's own token (client `default`) with an `X-CodeRunner-Client: NAME` header (the proxy
  sends one; any client may): NAME, made safe as a folder name; without one: `http`. These are
  the names earlier versions used, so existing export folders and named workspaces stay found;
- a token added with `coderunner token add T`: `t.T` without the header, `t.T.NAME` with it.
  No name of the server's own token can start with `t.` (folder_name moves it aside), and T
  holds no dot, so two tokens never share an export folder or a named workspace.
Within one token the header is what the client says it is: it keeps cooperating clients apart,
it does not authenticate one against another.

Every folder name is lowercase ASCII (`[a-z0-9._-]`), so two names that differ only in case or
Unicode form (`T.alice` and `t.alice`, `é` composed or not) cannot meet in one folder on a
case-insensitive or normalising file system (macOS's default). A name that is already canonical
keeps its folder; any other gets the lowercased safe form plus a short hash of the exact name.
Folders earlier versions made for names with capitals stay on disk untouched and are no longer
used (their owners find their files there by hand; nothing is moved or deleted).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from coderunner.edge.callers import CLIENT_HEADER, token_client
from coderunner.edge.client_tokens import PRIMARY_CLIENT
from coderunner.vocabulary.clients import LOCAL_CLIENT

ANONYMOUS_HTTP_CLIENT = "http"
_RESERVED = (LOCAL_CLIENT, ANONYMOUS_HTTP_CLIENT)
#: Folder names of added tokens' clients start with this; no other folder name does.
TOKEN_FOLDER_PREFIX = "t."
_UNSAFE = re.compile(r"[^a-z0-9._-]")
MAX_FOLDER_CHARS = 64
_HASH_CHARS = 8


def client_of(request: Any) -> str:
    """The owning client's folder name for the request behind a tool call (None: stdio)."""
    if request is None:
        return LOCAL_CLIENT
    token = token_client(request)
    headers = getattr(request, "headers", None) or {}
    name = headers.get(CLIENT_HEADER)
    if token == PRIMARY_CLIENT:
        return folder_name(name) if name else ANONYMOUS_HTTP_CLIENT
    return token_folder(token, name)


def token_folder(token: str, name: str | None) -> str:
    """The folder name of client `name` (None: no header) of the added token `token`."""
    base = TOKEN_FOLDER_PREFIX + token
    if not name:
        return base
    folder = f"{base}.{folder_name(name)}"
    if len(folder) > MAX_FOLDER_CHARS:
        keep = MAX_FOLDER_CHARS - len(base) - 2 - _HASH_CHARS
        folder = f"{base}.{folder_name(name)[:keep]}-{_short_hash(name)}"
    return folder


def _short_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:_HASH_CHARS]


def folder_name(name: str) -> str:
    """A stable, readable folder name for a client name; distinct names never share a folder, even
    on a file system that ignores case or normalises Unicode (the name is lowercase ASCII)."""
    safe = _UNSAFE.sub("_", name.lower())[:MAX_FOLDER_CHARS]
    if not safe[:1].isalnum() or safe.startswith(TOKEN_FOLDER_PREFIX):
        safe = "c" + safe
    if safe != name or safe in _RESERVED:
        safe = f"{safe[: MAX_FOLDER_CHARS - 1 - _HASH_CHARS]}-{_short_hash(name)}"
    return safe
