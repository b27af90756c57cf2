"""`%pip install` and `!pip install` in the kernel: install_packages' install, or an error that says why not.

An agent's first move is often `%pip install X`. Stock pip would write to the sandbox's read-only
environment, fail, and leave a cell that looks like success. Here `%pip install` (and `!pip install`,
`!pip3 install`, `!python -m pip install`, which an input transformer turns into `%pip install`)
takes what install_packages takes (requirement specifiers; -q and -U are accepted) and runs the same
guest code (packages.run): the session's own package folder, through the sandbox's own network,
whose proxy alone decides what is reached. Where that network cannot reach the package index, it
fails at once rather than after pip's retries: network 'none' with the host's own text (the
SESSION_INSTALL_REFUSAL variable the host sets, which names the ways out within the user's ceiling),
an allowlist without the index with the proxy's own refusal (index_probe.py, as for install_packages).
conda, mamba, micromamba and uv installs are refused naming what works. Other `!` commands run as
before, and so do other pip commands (list, show).
"""

import os
import re
import shlex
import sys

from .errors import GuestError
from .packages import REQUIREMENT
from .packages import run as run_pip

#: Set by the host in a sandbox with network 'none' (sandbox/common.py INSTALL_REFUSAL_ENV).
REFUSAL_ENV = "SESSION_INSTALL_REFUSAL"
#: Where the session's packages go (guest/__init__.py SESSION_PACKAGES_ENV).
TARGET_ENV = "SESSION_SITE_PACKAGES"
#: pip's bound: install_packages' default (tools/install_packages.py PIP_TIMEOUT_S); the cell's own
#: timeout still interrupts it first when shorter.
PIP_TIMEOUT_S = 300.0
MAX_PACKAGES = 32

#: pip options that change nothing here: output, the (always on) upgrade, and where it would go.
QUIET = frozenset({"-q", "--quiet", "-qq", "-qqq"})
HARMLESS = frozenset(
    {"-U", "--upgrade", "--user", "--no-cache-dir", "--disable-pip-version-check", "--no-warn-script-location"}
)
WORKS = "%pip install NAME (or the install_packages tool), e.g. %pip install requests 'pandas>=2'"

_PYTHON = r"(?:\{sys\.executable\}|(?:\S*/)?python[0-9.]*)"
#: A `!` command that is a pip install, and the part %pip gets ("install ...").
_PIP_SHELL = re.compile(rf"\s*(?:{_PYTHON}\s+-m\s+pip|(?:\S*/)?pip[0-9.]*)\s+(install(?:\s.*)?)\Z", re.S)
#: A trailing redirect of pip's output to nowhere (`> /dev/null 2>&1`), which changes nothing here.
_QUIET_REDIRECT = re.compile(r"\s+(?:[12&]?>>?\s*/dev/null|2>&1)\s*\Z")
#: `!` commands that install with another package manager: the magic that refuses them.
_OTHER_SHELL = re.compile(
    r"\s*(?:\S*/)?(conda|mamba|micromamba)\s+install\b|\s*(?:\S*/)?(uv)\s+(?:pip\s+install|add)\b"
)


class PackageInstallError(Exception):
    """%pip install could not install (and says why, and what works)."""

    def _render_traceback_(self):
        """IPython shows this instead of a traceback: the frames would be this module's, not the user's."""
        return [f"{type(self).__name__}: {self}"]


def shell_magic(command):
    """The (magic, line) a `!command` becomes, when it installs packages; else None."""
    match = _PIP_SHELL.match(command)
    if match:
        return "pip", match.group(1).strip()
    other = _OTHER_SHELL.match(command)
    if other:
        return other.group(1) or other.group(2), command.strip()
    return None


def install_words(line):
    """The words after `install` in a %pip line (a shell comment and a trailing output redirect to
    /dev/null dropped: this prints little), or None when the line is not an install."""
    while (quiet := _QUIET_REDIRECT.search(line)) is not None:
        line = line[: quiet.start()]
    try:
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        raise PackageInstallError(f"cannot read this pip command: {exc}") from None
    return words[1:] if words[:1] == ["install"] else None


def parse_install(words):
    """The requirement specifiers of `install WORDS...`, or PackageInstallError naming what is not accepted."""
    wanted, refused = [], []
    for word in words:
        if word in QUIET or word in HARMLESS:
            continue
        if word.startswith("-") or not REQUIREMENT.fullmatch(word):
            refused.append(word)
        else:
            wanted.append(word)
    if refused:
        shown = " ".join(shlex.quote(word) for word in refused[:5])
        raise PackageInstallError(
            f"%pip install here takes package names with optional versions (like requests or 'httpx==0.28.1') "
            f"and -q/-U, as install_packages does; not: {shown}. Options, paths, URLs, other indexes and "
            "shell operators are not accepted: run other commands on a line of their own"
        )
    if not wanted:
        raise PackageInstallError(f"name at least one package: {WORKS}")
    if len(wanted) > MAX_PACKAGES:
        raise PackageInstallError(f"at most {MAX_PACKAGES} packages per install")
    return wanted


def check_network():
    """PackageInstallError at once in a sandbox with network 'none' (pip would only retry there)."""
    refusal = os.environ.get(REFUSAL_ENV)
    if refusal:
        raise PackageInstallError(
            f"{refusal}\n(install_packages cannot either: it installs through the session's network)"
        )


def report(result):
    """install_packages' report, as lines for the cell."""
    got = ", ".join(f"{name}=={version}" if version else f"{name} (not found after pip ran)"
                    for name, version in result["installed"].items())  # fmt: skip
    lines = [f"installed {got} into {result['target']} (this session only, kept across kernel_reset)"]
    if result.get("startup_hooks"):
        hooks = ", ".join(result["startup_hooks"])
        lines.append(f"note: start-up hooks among this session's packages, run by every new interpreter: {hooks}")
    return "\n".join(lines)


def pip_install(words):
    """What `%pip install WORDS` does here."""
    wanted = parse_install(words)
    target = os.environ.get(TARGET_ENV)
    if not target:
        raise PackageInstallError(f"this sandbox has no session package folder ({TARGET_ENV} is not set)")
    check_network()
    shown = " ".join(wanted)
    try:  # an allowlist without the package index: refused before pip runs (packages.run)
        result = run_pip(wanted, target, PIP_TIMEOUT_S, started=lambda: print(f"pip install {shown} ...", flush=True))
    except GuestError as exc:
        raise PackageInstallError(str(exc)) from None
    print(report(result), flush=True)


def refuse(manager):
    """The line magic for another package manager: an error naming what works."""

    def magic(line):
        raise PackageInstallError(
            f"{manager} is not available in this sandbox: its Python environment is read-only, and packages go "
            f"to a folder of the session's own with pip. Use {WORKS}"
        )

    return magic


def install(ipython):
    """Register %pip (install here; other pip commands as IPython runs them), the refusing magics, and
    the transformer that sends `!pip install` and friends to them."""
    stock = ipython.find_line_magic("pip")

    def pip(line):
        """%pip install NAME...: into this session's own packages, as the install_packages tool does (-q, -U
        accepted). Other pip commands (list, show, ...) run as IPython's %pip runs them."""
        words = install_words(line)
        if words is None:
            if stock is None:
                raise PackageInstallError(f"only pip install is available here: {WORKS}")
            return stock(line)
        pip_install(words)
        return None

    ipython.register_magic_function(pip, "line", "pip")
    for manager in ("conda", "mamba", "micromamba", "uv"):
        ipython.register_magic_function(refuse(manager), "line", manager)
    _route_shell_installs(ipython)


def _route_shell_installs(ipython):
    """`!pip install ...` (and conda, uv installs) become their line magic; other `!` lines are untouched."""
    try:
        from IPython.core import inputtransformer2 as transforms

        stock = transforms.EscapedCommand
        manager = ipython.input_transformer_manager
        if stock not in manager.token_transformers:
            raise AttributeError("EscapedCommand")
        find_end, assemble = transforms.find_end_of_continued_line, transforms.assemble_continued_line
    except (ImportError, AttributeError) as exc:
        print(f"coderunner: !pip install is not routed to %pip ({exc!r}); %pip install works", file=sys.stderr)
        return

    class InstallCommand(transforms.EscapedCommand):
        """EscapedCommand, but a `!` line that installs calls the line magic that installs (or refuses)."""

        def transform(self, lines):
            end = find_end(lines, self.start_line)
            line = assemble(lines, (self.start_line, self.start_col), end)
            routed = shell_magic(line[1:]) if line.startswith("!") and not line.startswith("!!") else None
            if routed is None:
                return super().transform(lines)
            indent = lines[self.start_line][: self.start_col]
            call = f"get_ipython().run_line_magic({routed[0]!r}, {routed[1]!r})"
            return [*lines[: self.start_line], indent + call + "\n", *lines[end + 1 :]]

    manager.token_transformers = [InstallCommand if each is stock else each for each in manager.token_transformers]
