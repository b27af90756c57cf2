"""Which hosts and ports a session may reach: exact names, `*.` wildcards, IP literals, presets.

The user's setting is the ceiling; a session may ask for a subset of it (`narrowed`) and may be
widened one host at a time within it (`with_host`, after the user said yes), never beyond. Names are
compared in one canonical form (lowercase IDNA, no trailing dot), whether they come from the user's
setting or from a request line the sandbox wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..errors import CodeRunnerError

#: Where a user widens the ceiling; named in every refusal beyond it.
CEILING_SETTING = "`allowed_domains` (config, CODERUNNER_ALLOWED_DOMAINS or --allow-domain)"
DEFAULT_PORTS: tuple[int, ...] = (80, 443)

#: Named groups of entries, usable wherever an entry is. `python-packages` is what pip contacts by
#: default (read from pip itself, see _python_package_hosts); `github` is git over HTTPS, the API,
#: release downloads and raw files.
PRESETS: Mapping[str, tuple[str, ...]]


class EgressPolicyError(CodeRunnerError):
    """An allowlist entry that cannot be used, or a request beyond the user's ceiling; says the fix."""


def _python_package_hosts() -> tuple[str, ...]:
    """The index and file hosts pip uses by default, read from pip (the client this preset is for)."""
    raise NotImplementedError


class _Presets(Mapping[str, tuple[str, ...]]):
    """The preset table; `python-packages` is filled on first use (it imports pip's index model)."""

    def __init__(self) -> None:
        self._static: dict[str, tuple[str, ...]] = {
            "github": (
                "github.com",
                "*.github.com",
                "*.githubusercontent.com",
                "codeload.github.com",
                "objects.githubusercontent.com",
            ),
        }
        self._lazy: dict[str, Callable[[], tuple[str, ...]]] = {"python-packages": _python_package_hosts}

    def __getitem__(self, name: str) -> tuple[str, ...]:
        if name in self._static:
            return self._static[name]
        return self._lazy[name]()

    def __iter__(self) -> Iterator[str]:
        yield from self._static
        yield from self._lazy

    def __len__(self) -> int:
        return len(self._static) + len(self._lazy)


PRESETS = _Presets()


@dataclass(frozen=True)
class EgressPolicy:
    """A normalised allowlist: canonical entries (names, `*.suffix` wildcards, IP literals) and ports."""

    hosts: tuple[str, ...]
    ports: frozenset[int]

    @classmethod
    def parse(cls, entries: Sequence[str], ports: Sequence[int] = DEFAULT_PORTS) -> EgressPolicy:
        """Normalise user entries (presets expanded); EgressPolicyError names the first bad one."""
        raise NotImplementedError

    def allows(self, host: str, port: int) -> bool:
        """Whether a client may reach host:port, host as the client sent it (normalised here too).

        A name never matches an IP-literal entry and an IP literal never matches a name entry.
        Anything that cannot be normalised is not allowed.
        """
        raise NotImplementedError

    def covers(self, entry: str) -> bool:
        """Whether a canonical entry (a wildcard included) lies wholly inside this policy's hosts."""
        raise NotImplementedError

    def narrowed(self, asked: Sequence[str]) -> EgressPolicy:
        """The subset a session asks for (same ports); every entry must lie inside self, the ceiling."""
        raise NotImplementedError

    def with_host(self, host: str) -> EgressPolicy:
        """This policy plus one exact host name or IP literal (no wildcard, no preset)."""
        raise NotImplementedError

    def describe(self) -> str:
        """A short human form for messages: hosts (first few, then "and N more") and ports."""
        raise NotImplementedError


def normalize_host(host: str) -> str:
    """The canonical form of one host as a client sends it: lowercase IDNA name or compressed IP.

    Brackets around an IPv6 literal are accepted and dropped. Raises EgressPolicyError if it is no
    valid host name or IP literal.
    """
    raise NotImplementedError
