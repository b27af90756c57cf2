"""Files in a reopened workspace that Python would run at start-up, before anyone asked.

A session's package folder (/workspace/.coderunner/site-packages) is on the kernel's PYTHONPATH,
so a `sitecustomize` or `usercustomize` module there runs in every interpreter the next session
starts. Code of an earlier session could have planted one. When a persistent workspace is
reopened, the host (before any sandbox runs for it) moves such modules into
`.coderunner/disabled-startup/`, through directory fds without following a link, and the reply
of create_session names them; they never run unless the user moves them back. `.pth` files in
that folder are inert (it is a PYTHONPATH entry, not a site dir, so Python never reads them); they
are named in the reply too. The packages themselves are listed: installing them was asked for,
but the list keeps what the next session imports from there from being a surprise.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .sandbox import SESSION_PACKAGES

HOOK_MODULES = ("sitecustomize", "usercustomize")
DISABLED_DIR = "disabled-startup"
#: Entries of the package folder looked at, and named in a reply, at most.
MAX_ENTRIES = 5000
MAX_LISTED = 50
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class StartupReport:
    disabled: list[str] = field(default_factory=list)
    inert_pth: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object] | None:
        if not (self.disabled or self.inert_pth or self.packages):
            return None
        report: dict[str, object] = {"folder": f"/workspace/{SESSION_PACKAGES}"}
        if self.disabled:
            report["disabled"] = self.disabled
            report["note"] = (
                "start-up hooks left by an earlier session were moved to "
                f"/workspace/.coderunner/{DISABLED_DIR}/ and will not run; move one back only if you trust it"
            )
        if self.inert_pth:
            report["ignored_pth"] = self.inert_pth
        if self.packages:
            report["packages"] = self.packages[:MAX_LISTED]
        return report


def _is_hook(name: str) -> bool:
    stem = name.split(".", 1)[0]
    return stem in HOOK_MODULES


def disable_startup_hooks(workspace: Path) -> StartupReport:
    """Move start-up modules out of the session package folder of a workspace no sandbox is using.

    The sandbox resolves PYTHONPATH itself, following links: a `.coderunner` or `site-packages`
    that is a link (or anything but a plain folder) is moved aside whole, as a hook would be.
    """
    report = StartupReport()
    try:
        top = os.open(workspace, DIR_FLAGS)
    except OSError:
        return report
    fds = [top]
    try:
        for index, part in enumerate(SESSION_PACKAGES.split("/")):
            try:
                info = os.stat(part, dir_fd=fds[-1], follow_symlinks=False)
            except FileNotFoundError:
                return report  # nothing is imported from a folder that is not there
            if not stat.S_ISDIR(info.st_mode):
                if index == 0:
                    os.rename(part, f"{part}.disabled-{secrets.token_hex(3)}", src_dir_fd=top, dst_dir_fd=top)
                    report.disabled.append(f"/workspace/{part} (not a folder) -> /workspace/{part}.disabled-*")
                else:
                    _move_aside(fds[-1], fds[1], part)
                    report.disabled.append(f"{part} (not a folder)")
                return report
            fds.append(os.open(part, DIR_FLAGS, dir_fd=fds[-1]))
        packages_fd, coderunner_fd = fds[-1], fds[1]
        with os.scandir(packages_fd) as entries:
            names = [entry.name for _, entry in zip(range(MAX_ENTRIES), entries, strict=False)]
        for name in sorted(names):
            if _is_hook(name):
                _move_aside(packages_fd, coderunner_fd, name)
                report.disabled.append(name)
            elif name.endswith(".pth"):
                report.inert_pth.append(name)
            elif not name.endswith((".dist-info", ".egg-info")) and not name.startswith(("_", ".")):
                report.packages.append(name)
        return report
    finally:
        for fd in fds:
            os.close(fd)


def _move_aside(packages_fd: int, coderunner_fd: int, name: str) -> None:
    """renameat into .coderunner/disabled-startup/ (a rename moves the entry itself, link or not)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(DISABLED_DIR, 0o755, dir_fd=coderunner_fd)
    target = os.open(DISABLED_DIR, DIR_FLAGS, dir_fd=coderunner_fd)
    try:
        info = os.fstat(target)
        if not stat.S_ISDIR(info.st_mode):
            raise OSError("not a folder")
        with contextlib.suppress(FileNotFoundError):
            os.rename(name, f"{name}.{secrets.token_hex(3)}", src_dir_fd=packages_fd, dst_dir_fd=target)
    finally:
        os.close(target)
