"""What install_packages accepts: requirement specifiers only, never pip options, paths or URLs."""

from __future__ import annotations

import re

from coderunner.errors import CodeRunnerError

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?"
_VERSION = r"[<>=!~]=?[A-Za-z0-9.*+!_-]+"
REQUIREMENT = re.compile(f"{_NAME}({_VERSION}(,{_VERSION})*)?")
MAX_PACKAGES = 32


class PackagesError(CodeRunnerError):
    """A package list pip must not be given; the message names the bad entry."""


def check_requirements(packages: list[str]) -> list[str]:
    if not packages:
        raise PackagesError("name at least one package, e.g. ['requests'] or ['httpx==0.28.1']")
    if len(packages) > MAX_PACKAGES:
        raise PackagesError(f"at most {MAX_PACKAGES} packages per call")
    for package in packages:
        if not REQUIREMENT.fullmatch(package):
            raise PackagesError(
                f"{package!r} is not a requirement specifier: use a name with an optional version, e.g. "
                "'requests' or 'pandas>=2,<3' (no options, paths or URLs)"
            )
    return packages
