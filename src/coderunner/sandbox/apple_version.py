"""Apple `container` releases: which this server runs on, and what each lacks (read once from
`container --version`; the backend's argv, doctor and the image build all follow it)."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ContainerVersion:
    """A `container` release, read once from `container --version`, and what it changes for us."""

    major: int
    minor: int
    patch: int

    @classmethod
    def parse(cls, text: str) -> ContainerVersion | None:
        """`container CLI version 0.6.0 (build: release, commit: 1a2b3c4)` (ReleaseVersion.swift)."""
        found = re.search(r"version (\d+)\.(\d+)\.(\d+)", text)
        return cls(*(int(part) for part in found.groups())) if found else None

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def has_init(self) -> bool:
        """`run --init` (Flags.Management.useInit) exists from 0.10.0; older versions reject it."""
        return self >= INIT_VERSION

    @property
    def has_build_secret(self) -> bool:
        """`build --secret id=..,src=..` (BuildCommand.swift) exists from 0.11.0; older versions reject it."""
        return self >= SECRET_VERSION


#: `--network none` exists from 0.6.0 (Utility.containerConfigFromFlags): nothing older runs here.
MIN_VERSION = ContainerVersion(0, 6, 0)
INIT_VERSION = ContainerVersion(0, 10, 0)
#: The image build can be handed a TLS root (for pip behind a TLS-intercepting proxy) from here on.
SECRET_VERSION = ContainerVersion(0, 11, 0)
#: What install.sh installs on both paths (Homebrew, or Apple's signed package).
PINNED_VERSION = ContainerVersion(1, 2, 2)
UPGRADE_HINT = (
    f"upgrade with `brew upgrade container`, or run ./install.sh (it installs Apple's signed package {PINNED_VERSION})"
)


def version_problem(version: ContainerVersion | None) -> str | None:
    """Why this `container` cannot run sessions (UPGRADE_HINT is the fix), or None."""
    if version is None:
        return "could not read the version of `container` (`container --version`)"
    if version < MIN_VERSION:
        return f"Apple container {version} is older than {MIN_VERSION}, the oldest this server supports"
    return None


def version_caveat(version: ContainerVersion) -> str | None:
    """What a supported but old version lacks (doctor shows it, with UPGRADE_HINT as the fix)."""
    if version < INIT_VERSION:
        return (
            f"works, but {version} predates 0.10.0: no `run --init` (the guest's first process reaps instead), "
            "an older socket relay, and no `build --secret` (where TLS is intercepted the image cannot be built)"
        )
    if version < SECRET_VERSION:
        return (
            f"works, but {version} predates 0.11.0: no `build --secret`, so where TLS is intercepted the image "
            "build cannot be given the network's root"
        )
    return None
