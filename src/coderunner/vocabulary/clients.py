"""The client a sandbox belongs to when no HTTP client is named: the stdio server's one user.

edge/owners.py tells clients apart; a sandbox request (sandbox_request.py) defaults to this one.
"""

from __future__ import annotations

#: The stdio server's client, and every sandbox's owner unless a caller's client is known.
LOCAL_CLIENT = "local"
