"""Which hosts and ports a session may reach: exact names, `*.` wildcards, IP literals, presets.

The user's setting is the ceiling; a session may ask for a subset of it (`narrowed`) and may be
widened one host at a time within it (`with_host`, after the user said yes), never beyond. Names are
compared in one canonical form (lowercase IDNA, no trailing dot), whether they come from the user's
setting or from a request line the sandbox wrote.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import idna

from coderunner.errors import CodeRunnerError

#: Where a user widens the ceiling; named in every refusal beyond it.
CEILING_SETTING = "`allowed_domains` (config, CODERUNNER_ALLOWED_DOMAINS or --allow-domain)"
DEFAULT_PORTS: tuple[int, ...] = (80, 443)

#: Named groups of entries, usable wherever an entry is. `python-packages` is what pip contacts by
#: default (read from pip itself, see _python_package_hosts); `github` is git over HTTPS, the API,
#: archives, release downloads and raw files.
PRESETS: Mapping[str, tuple[str, ...]]


class EgressPolicyError(CodeRunnerError):
    """An allowlist entry that cannot be used, or a request beyond the user's ceiling; says the fix."""


def _python_package_hosts() -> tuple[str, ...]:
    """The index and file hosts pip uses by default, read from pip (the client this preset is for).

    Read rather than spelled here, so the preset follows pip. pip's index model is a small module
    that imports nothing heavy.
    """
    try:
        from pip._internal.models.index import PyPI

        hosts = (str(PyPI.netloc), str(PyPI.file_storage_domain))
    except (ImportError, AttributeError) as exc:
        raise EgressPolicyError(
            "the `python-packages` preset takes the package index's host names from pip, which this "
            f"server's Python cannot import ({exc}); install pip beside coderunner, or list the index "
            f"hosts yourself in {CEILING_SETTING}."
        ) from None
    return hosts


class _Presets(Mapping[str, tuple[str, ...]]):
    """The preset table; `python-packages` is filled on first use (it imports pip's index model)."""

    def __init__(self) -> None:
        self._static: dict[str, tuple[str, ...]] = {
            # *.github.com covers api and codeload (archives); *.githubusercontent.com raw files and
            # release assets (objects.).
            "github": ("github.com", "*.github.com", "*.githubusercontent.com"),
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


#: An ASCII label as DNS names use them (underscore tolerated: some real HTTP hosts have one).
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
#: A last label that makes a WHATWG URL parser (and getaddrinfo) read the name as an IPv4 number.
_NUMERIC_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)")
#: Second-level labels under a country code that are public suffixes (co.uk, com.au, ...).
_CC_SECOND_LEVEL = frozenset({"ac", "co", "com", "edu", "go", "gov", "ne", "net", "or", "org"})
_MAX_NAME = 253
_ENTRY_HELP = (
    "Use an exact host name (api.example.com), a wildcard for its subdomains (*.example.com), "
    "an IP address, or a preset ({presets})."
)
_DESCRIBE_HOSTS = 8


@dataclass(frozen=True)
class EgressPolicy:
    """A normalised allowlist: canonical entries (names, `*.suffix` wildcards, IP literals) and ports."""

    hosts: tuple[str, ...]
    ports: frozenset[int]

    @classmethod
    def parse(cls, entries: Sequence[str], ports: Sequence[int] = DEFAULT_PORTS) -> EgressPolicy:
        """Normalise user entries (presets expanded); EgressPolicyError names the first bad one."""
        if isinstance(entries, str):
            entries = [entries]
        hosts: list[str] = []
        for entry in entries:
            for canonical in _expand(entry):
                if canonical not in hosts:
                    hosts.append(canonical)
        return cls(hosts=tuple(hosts), ports=_check_ports(ports))

    def allows(self, host: str, port: int) -> bool:
        """Whether a client may reach host:port, host as the client sent it (normalised here too).

        A name never matches an IP-literal entry and an IP literal never matches a name entry.
        Anything that cannot be normalised is not allowed.
        """
        if port not in self.ports:
            return False
        try:
            canonical = normalize_host(host)
        except EgressPolicyError:
            return False
        return self._allows_host(canonical)

    def covers(self, entry: str) -> bool:
        """Whether a canonical entry (a wildcard included) lies wholly inside this policy's hosts."""
        if entry.startswith("*."):
            suffix = entry[2:]
            return any(h.startswith("*.") and _within(suffix, h[2:]) for h in self.hosts)
        return self._allows_host(entry)

    def narrowed(self, asked: Sequence[str]) -> EgressPolicy:
        """The subset a session asks for (same ports); every entry must lie inside self, the ceiling.

        An empty request gives a policy that allows nothing (callers that mean "the whole ceiling"
        pass the ceiling on instead).
        """
        wanted = EgressPolicy.parse(asked, tuple(sorted(self.ports)) or DEFAULT_PORTS)
        outside = [h for h in wanted.hosts if not self.covers(h)]
        if outside:
            raise EgressPolicyError(
                f"{_quoted(outside)} {'is' if len(outside) == 1 else 'are'} outside the network allowlist the "
                f"user set (allowed: {self.describe()}). A session can only narrow it; the user can widen "
                f"it with {CEILING_SETTING}."
            )
        return EgressPolicy(hosts=wanted.hosts, ports=self.ports)

    def entry_for(self, host: str) -> str:
        """What to ask for to reach `host` within this ceiling: the preset holding it where the ceiling
        covers the whole preset (pip needs the index and its file host: naming one fails on the other),
        else the host itself."""
        try:
            canonical = normalize_host(host)
        except EgressPolicyError:
            return host
        for name in PRESETS:
            try:
                preset = EgressPolicy.parse([name], tuple(sorted(self.ports)) or DEFAULT_PORTS)
            except EgressPolicyError:
                continue  # a preset this server cannot fill (no pip): never the hint
            if preset._allows_host(canonical) and all(self.covers(entry) for entry in preset.hosts):
                return name
        return host

    def with_host(self, host: str) -> EgressPolicy:
        """This policy plus one exact host name or IP literal (no wildcard, no preset)."""
        canonical = normalize_host(host)
        if canonical in self.hosts:
            return self
        return EgressPolicy(hosts=(*self.hosts, canonical), ports=self.ports)

    def describe(self) -> str:
        """A short human form for messages: hosts (first few, then "and N more") and ports."""
        if not self.hosts:
            return "no hosts"
        shown = ", ".join(self.hosts[:_DESCRIBE_HOSTS])
        more = len(self.hosts) - _DESCRIBE_HOSTS
        if more > 0:
            shown += f" and {more} more"
        ports = ", ".join(str(p) for p in sorted(self.ports))
        return f"{shown} on port{'s' if len(self.ports) != 1 else ''} {ports}"

    def _allows_host(self, canonical: str) -> bool:
        if canonical in self.hosts:
            return True
        if _is_ip(canonical):
            return False
        return any(h.startswith("*.") and canonical.endswith(h[1:]) for h in self.hosts)


def normalize_host(host: str) -> str:
    """The canonical form of one host as a client sends it: lowercase IDNA name or compressed IP.

    Brackets around an IPv6 literal are accepted and dropped. Raises EgressPolicyError if it is no
    valid host name or IP literal.
    """
    if not isinstance(host, str) or not host:
        raise EgressPolicyError("an empty host name is not a host")
    if len(host) > 4 * _MAX_NAME:
        raise EgressPolicyError(f"`{host[:40]}...` is too long to be a host name")
    if "%" in host:
        raise EgressPolicyError(
            f"`{_show(host)}` has a `%` (a zone index or percent-encoding); give the name or address plainly"
        )
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            raise EgressPolicyError(f"`{_show(host)}` has an unbalanced bracket")
        inner = host[1:-1]
        try:
            return str(ipaddress.IPv6Address(inner))
        except ValueError:
            raise EgressPolicyError(f"`{_show(host)}` is not an IPv6 address in brackets") from None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    return _normalize_name(host)


def _normalize_name(name: str) -> str:
    shown = _show(name)
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in name):
        raise EgressPolicyError(f"`{shown}` contains a space or control character")
    try:
        mapped = idna.uts46_remap(name, std3_rules=False, transitional=False)
    except (idna.IDNAError, UnicodeError, ValueError) as exc:
        raise EgressPolicyError(f"`{shown}` is not a valid host name ({exc})") from None
    if mapped.endswith("."):
        mapped = mapped[:-1]
    labels = mapped.split(".")
    out: list[str] = []
    for label in labels:
        if not label:
            raise EgressPolicyError(f"`{shown}` has an empty label (two dots in a row, or a leading dot)")
        out.append(_a_label(label, shown))
    if _NUMERIC_LABEL.fullmatch(out[-1]):
        raise EgressPolicyError(f"`{shown}` looks like a number, not a name; give an IP address in dotted form")
    canonical = ".".join(out)
    if len(canonical) > _MAX_NAME:
        raise EgressPolicyError(f"`{shown}` is longer than a DNS name can be")
    return canonical


def _a_label(label: str, shown: str) -> str:
    if label.isascii():
        label = label.lower()
        if not _LABEL.fullmatch(label):
            raise EgressPolicyError(f"`{shown}` has an invalid label `{label}`")
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError, ValueError):
                raise EgressPolicyError(f"`{shown}` has an invalid punycode label `{label}`") from None
        return label
    try:
        return idna.alabel(label).decode("ascii")
    except (idna.IDNAError, UnicodeError, ValueError) as exc:
        raise EgressPolicyError(f"`{shown}` is not a valid international host name ({exc})") from None


def _expand(entry: str) -> tuple[str, ...]:
    """One user entry in canonical form: a preset's entries, a wildcard or one host."""
    if not isinstance(entry, str):
        raise EgressPolicyError(f"allowlist entries are text, not {type(entry).__name__}")
    text = entry.strip()
    if text.lower() in PRESETS:
        return tuple(_expand_one(e) for e in PRESETS[text.lower()])
    return (_expand_one(text),)


def _expand_one(text: str) -> str:
    help_ = _ENTRY_HELP.format(presets=", ".join(PRESETS))
    if not text:
        raise EgressPolicyError(f"an allowlist entry is empty. {help_}")
    if "://" in text or "/" in text:
        raise EgressPolicyError(f"`{_show(text)}` is a URL, not a host. {help_}")
    if text.startswith("*."):
        suffix = text[2:]
        if "*" in suffix:
            raise EgressPolicyError(f"`{_show(text)}`: a wildcard can only be the whole first label. {help_}")
        try:
            canonical = _normalize_name(suffix)
        except EgressPolicyError as exc:
            raise EgressPolicyError(f"{exc}. {help_}") from None
        _check_wildcard_suffix(text, canonical)
        return "*." + canonical
    if "*" in text:
        raise EgressPolicyError(
            f"`{_show(text)}`: a wildcard must be `*.` followed by a domain (*.example.com). {help_}"
        )
    if _looks_like_host_port(text):
        raise EgressPolicyError(f"`{_show(text)}` has a port; ports are a separate setting. {help_}")
    try:
        return normalize_host(text)
    except EgressPolicyError as exc:
        raise EgressPolicyError(f"{exc}. {help_}") from None


def _check_wildcard_suffix(text: str, suffix: str) -> None:
    labels = suffix.split(".")
    public = len(labels) == 1 or (
        len(labels) == 2 and len(labels[1]) == 2 and labels[1].isalpha() and labels[0] in _CC_SECOND_LEVEL
    )
    if public or _is_ip(suffix):
        raise EgressPolicyError(
            f"`{_show(text)}` would allow a whole top-level domain; name a domain someone owns (*.example.com)."
        )


def _looks_like_host_port(text: str) -> bool:
    if text.count(":") != 1:
        return False  # a bare IPv6 address has several colons
    _, port = text.rsplit(":", 1)
    return port.isdigit() or port == ""


def _check_ports(ports: Sequence[int]) -> frozenset[int]:
    out: set[int] = set()
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise EgressPolicyError(f"`{port!s}` is not a port; allowed ports are whole numbers from 1 to 65535.")
        out.add(port)
    if not out:
        raise EgressPolicyError("the allowlist has no ports; give at least one (443 for HTTPS, 80 for HTTP).")
    return frozenset(out)


def _within(name: str, domain: str) -> bool:
    """name is domain or one of its subdomains."""
    return name == domain or name.endswith("." + domain)


def _is_ip(canonical: str) -> bool:
    try:
        ipaddress.ip_address(canonical)
    except ValueError:
        return False
    return True


def _quoted(hosts: Sequence[str]) -> str:
    return ", ".join(f"`{h}`" for h in hosts)


def _show(text: str) -> str:
    """text made safe and short for an error message (no control characters, bounded)."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in text)
    return clean if len(clean) <= 80 else clean[:77] + "..."
