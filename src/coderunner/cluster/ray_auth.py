"""Ray's token authentication as a front door meets it: a failed join that was the token says so.

A cluster started with RAY_AUTH_MODE=token refuses every process that lacks its token. ray.init then
retries for about 20 s and says only "Failed to connect to Ray cluster at ..."; a front door whose join
failed asks the cluster's GCS once more itself and, when the token was the reason, refuses to start
saying whether its token was missing or wrong, and what to set (docs/cluster.md).

The token is Ray's alone: Ray reads it (RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN, ~/.ray/auth_token) in each
process that needs it. CodeRunner never reads, sends or stores it, so no session setting, node call or
sandbox is given it.
"""

from __future__ import annotations

import socket

from ray._private.authentication.authentication_utils import is_token_auth_enabled
from ray._raylet import AuthenticationTokenLoader, InnerGcsClient  # type: ignore[attr-defined]
from ray.exceptions import AuthenticationError

from coderunner.config import ConfigError

#: Bound on reaching the GCS's port at all: an unreachable cluster is not a token question (Ray's error stands).
REACH_S = 2.0
#: Bound on the GCS's answer to the one call that tells a refused token from anything else (it takes ms).
ASK_MS = 5000
#: What a front door needs, in the words of every refusal here.
HOW = (
    "start the front door with RAY_AUTH_MODE=token and the cluster's token, as on its nodes: in a file only "
    "its user reads, named by RAY_AUTH_TOKEN_PATH (or ~/.ray/auth_token, or in RAY_AUTH_TOKEN); see "
    "docs/cluster.md"
)


def token_refusal(address: str | None) -> ConfigError | None:
    """Why joining the Ray cluster at `address` (HOST:PORT of its GCS) failed, when it was Ray's token; else None.

    Called after ray.init failed: the one extra call costs nothing on a join that works.
    """
    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit():
        return None  # 'auto' or a ray:// client address: no GCS address to ask
    token_mode = is_token_auth_enabled()
    if token_mode and not _has_token():
        # Ray's own client would abort this process when asked to call without the token it was told to use.
        return ConfigError(f"this front door has RAY_AUTH_MODE=token but no Ray token was found: {HOW}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_S):
            pass
    except OSError:
        return None
    try:
        InnerGcsClient.standalone(address, None, ASK_MS)
    except AuthenticationError:
        if token_mode:
            return ConfigError(
                f"the Ray cluster at {address} refused this front door's Ray token: it is not the token the "
                f"cluster's nodes were started with; {HOW}"
            )
        return ConfigError(f"the Ray cluster at {address} requires Ray's token authentication, and this front door "
                           f"has no token; {HOW}")  # fmt: skip
    except Exception:  # any other failure: Ray's own error says it better
        return None
    return None


def _has_token() -> bool:
    """Whether Ray finds a token for this process (in token mode it raises, rather than say no)."""
    try:
        return bool(AuthenticationTokenLoader.instance().has_token())
    except AuthenticationError:
        return False
