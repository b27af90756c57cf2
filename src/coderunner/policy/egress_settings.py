"""The user's egress settings as egress reads them: the modes and the host ceiling, parsed once.

Beside the ceiling's policy (egress.py) rather than in egress/: the settings build it (config sits
under the egress machinery and imports only policy and the vocabulary).

`Settings.egress` builds one EgressSettings the first time anything asks (the server's start: its
SessionManager and ToolContext) and hands the same one out after, so the ceiling that option checks,
each sandbox's proxy and each call's denial notes measure against is one parsed policy. Should the
Settings it came from be changed in place, the next read sees that and parses again: a ceiling is
never older than the settings it claims to be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from coderunner.policy.egress import EgressPolicy
from coderunner.vocabulary.network import NetworkMode, default_ceiling


class EgressFields(Protocol):
    """The settings' egress fields, as config's Settings has them (read here without importing config)."""

    @property
    def network(self) -> str: ...
    @property
    def max_network(self) -> str | None: ...
    @property
    def allowed_domains(self) -> Sequence[str]: ...
    @property
    def allowed_ports(self) -> Sequence[int]: ...
    @property
    def egress_audit_log(self) -> Path | None: ...


@dataclass(frozen=True)
class EgressSettings:
    """What the user set for the network, with allowed_domains and allowed_ports parsed."""

    #: The network of sessions and one-shot runs that ask for none.
    network: NetworkMode
    #: The most network an agent may ask for (max_network, or what the user turned on).
    max_network: NetworkMode
    allowed_domains: tuple[str, ...]
    allowed_ports: tuple[int, ...]
    #: Where every allowlist decision is appended (None: per session only).
    audit_log: Path | None
    #: The most any allowlist sandbox may reach: allowed_domains on allowed_ports, parsed.
    ceiling: EgressPolicy

    @classmethod
    def of(cls, settings: EgressFields) -> EgressSettings:
        """Read the settings' egress fields and parse the ceiling (EgressPolicyError if it is bad)."""
        domains, ports = tuple(settings.allowed_domains), tuple(settings.allowed_ports)
        return cls(
            network=NetworkMode(settings.network),
            max_network=NetworkMode(default_ceiling(settings.network, domains, settings.max_network)),
            allowed_domains=domains,
            allowed_ports=ports,
            audit_log=settings.egress_audit_log,
            ceiling=EgressPolicy.parse(domains, ports),
        )

    def reads(self, settings: EgressFields) -> bool:
        """Whether these are still what `settings` say (nothing was changed in place since)."""
        return (
            self.network == settings.network
            and self.allowed_domains == tuple(settings.allowed_domains)
            and self.allowed_ports == tuple(settings.allowed_ports)
            and self.max_network == default_ceiling(settings.network, self.allowed_domains, settings.max_network)
            and self.audit_log == settings.egress_audit_log
        )

    @property
    def names_hosts(self) -> bool:
        """Whether the user allowed any hosts (network 'allowlist' needs some)."""
        return bool(self.allowed_domains)
