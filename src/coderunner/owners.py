"""Which client owns what a session leaves behind: its exported files and its persistent names.

The caller keys of callers.py pick a default session and can be per connection; ownership must
outlive a connection, so it is keyed on a stable client name instead:
- stdio (and the CLI): `local`, the one user of that server;
- HTTP with an `X-CodeRunner-Client: NAME` header (the proxy sends one; any client may): NAME,
  made safe as a folder name;
- HTTP without one: `http`, shared by every unnamed HTTP client of that server.
The name is what the client says it is: every HTTP caller holds the server's token, so this keeps
cooperating clients apart, it does not authenticate one against another.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .callers import CLIENT_HEADER

LOCAL_CLIENT = "local"
ANONYMOUS_HTTP_CLIENT = "http"
_RESERVED = (LOCAL_CLIENT, ANONYMOUS_HTTP_CLIENT)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_FOLDER_CHARS = 64


def client_of(request: Any) -> str:
    """The owning client's folder name for the request behind a tool call (None: stdio)."""
    if request is None:
        return LOCAL_CLIENT
    headers = getattr(request, "headers", None) or {}
    name = headers.get(CLIENT_HEADER)
    return folder_name(name) if name else ANONYMOUS_HTTP_CLIENT


def folder_name(name: str) -> str:
    """A stable, readable folder name for a client name; distinct names never share a folder."""
    safe = _UNSAFE.sub("_", name)[:MAX_FOLDER_CHARS]
    if not safe[:1].isalnum():
        safe = "c" + safe
    if safe != name or safe in _RESERVED:
        safe = f"{safe[: MAX_FOLDER_CHARS - 9]}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return safe
