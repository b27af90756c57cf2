"""How far the network may go: the user's ceiling, which an agent may go under but never over.

The modes are ordered: none < allowlist < internet. The user sets the ceiling (`max_network`), or
it follows from what they turned on: `internet` only when they made it the default network,
`allowlist` when they allowed some domains, else `none`. An agent may be following a prompt
injection, so a request above the ceiling is refused from every tool, and nothing the server
writes (capabilities, hints, schemas) offers a mode above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum


class NetworkMode(StrEnum):
    """A sandbox's network, least to most: the order is the ceiling's (a StrEnum: equal to its name)."""

    NONE = "none"
    ALLOWLIST = "allowlist"
    INTERNET = "internet"

    def __repr__(self) -> str:
        """As its name in quotes, like the plain string it replaces: messages say 'none', not <NetworkMode...>."""
        return repr(self.value)


#: Least to most network.
MODES: tuple[str, ...] = tuple(mode.value for mode in NetworkMode)

#: Where the user raises the ceiling, in the words every refusal uses.
CEILING_SETTING = "max_network (config.toml), CODERUNNER_MAX_NETWORK or `coderunner serve --max-network MODE`"


class NetworkCeilingError(ValueError):
    """A network mode above the user's ceiling was asked for."""


def rank(mode: str) -> int:
    """A mode's place in MODES (an unknown mode is the backends' to refuse, by name)."""
    return MODES.index(mode)


def default_ceiling(network: str, allowed_domains: Sequence[str], max_network: str | None) -> NetworkMode:
    """The ceiling: `max_network` when set, else the most the user turned on."""
    if max_network is not None:
        return NetworkMode(max_network)
    if network == NetworkMode.INTERNET:
        return NetworkMode.INTERNET
    if allowed_domains or network == NetworkMode.ALLOWLIST:
        return NetworkMode.ALLOWLIST
    return NetworkMode.NONE


def modes_within(ceiling: str) -> tuple[str, ...]:
    """The modes an agent may ask for under this ceiling, least first."""
    return MODES[: rank(ceiling) + 1]


def check_within(mode: str, ceiling: str) -> None:
    """Raise NetworkCeilingError when `mode` is above `ceiling`, with what the agent should do."""
    if mode not in MODES or rank(mode) <= rank(ceiling):
        return
    allowed = " or ".join(repr(each) for each in modes_within(ceiling))
    hosts = "; for 'allowlist' the user also names the hosts: allowed_domains" if mode == NetworkMode.ALLOWLIST else ""
    raise NetworkCeilingError(
        f"network {mode!r} is above what the user allows on this server (at most {ceiling!r}): use {allowed}, "
        f"or ask the user to raise it ({CEILING_SETTING}{hosts}); an agent cannot raise it"
    )


def more_network(ceiling: str) -> str:
    """How an agent gets more network for a task, naming only modes within the ceiling."""
    allowlist = "create_session(network='allowlist', allow=[...]) (only hosts the user allowed)"
    if ceiling == NetworkMode.INTERNET:
        return f"create a session with {allowlist} or create_session(network='internet') (the whole internet)"
    if ceiling == NetworkMode.ALLOWLIST:
        return f"create a session with {allowlist}"
    return "the user allows no network on this server: ask the user if the task needs it"


def install_way_out(ceiling: str) -> str:
    """Where install_packages can work, naming only modes within the ceiling."""
    if ceiling not in (NetworkMode.ALLOWLIST, NetworkMode.INTERNET):
        return more_network(ceiling)
    packages = (
        "create_session(network='allowlist', allow=['python-packages']) (only the package index, if the user "
        "allowed it in allowed_domains)"
    )
    internet = " or create_session(network='internet') (code there can reach the whole internet)"
    return f"create a session with {packages}{internet if ceiling == NetworkMode.INTERNET else ''}, and install there"


def offline_install(ceiling: str, who: str = "this session") -> str:
    """Why nothing installs in a session with network 'none', and where it can: install_packages' refusal
    and the kernel's %pip's (the host hands it to the sandbox: sandbox/common.py spec_environment), one text."""
    return f"installing packages needs network, and {who} has network 'none': {install_way_out(ceiling)}"
