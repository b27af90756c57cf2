"""What a caller asks of a session's or a one-shot run's sandbox, before the settings' defaults and checks.

One value instead of ten keywords written at every door (the SessionManager, the cluster's front door,
the seam both satisfy, sessions/sandbox_options.py that checks it): a tool builds one from its
arguments, and sandbox_options turns it into the checked SandboxOptions. Empty fields mean the
settings' default.
"""

from __future__ import annotations

from dataclasses import dataclass

from coderunner.vocabulary.clients import LOCAL_CLIENT
from coderunner.vocabulary.mounts import MountSpec


@dataclass(frozen=True)
class SandboxRequest:
    """A sandbox as asked for: network, limits, timeout, mounts, name and what it keeps."""

    network: str | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    timeout_s: float | None = None
    mounts: tuple[MountSpec, ...] = ()
    name: str | None = None
    persistent: bool = False
    #: The client that owns its exports and its persistent name.
    client: str = LOCAL_CLIENT
    #: Network 'allowlist': the entries asked for (a subset of allowed_domains); empty: the whole ceiling.
    allow: tuple[str, ...] = ()
    #: A persistent session that saves its kernel state when it closes and loads it when reopened.
    keep_state: bool = False


#: Nothing asked: every field the settings' default.
DEFAULT_REQUEST = SandboxRequest()
