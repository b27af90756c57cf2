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

Modules at the top of the workspace named like the standard library's or the kernel's own
(json.py, ipykernel_launcher.py, zmq/) are named as well. They no longer run at start-up (every
interpreter the product starts does so with -P: sandbox/common.py product_python), but user code
that imports such a name after the kernel is up may get the workspace's copy.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from coderunner.sandbox import SESSION_PACKAGES

HOOK_MODULES = ("sitecustomize", "usercustomize")
DISABLED_DIR = "disabled-startup"
#: Entries of the package folder looked at, and named in a reply, at most.
MAX_ENTRIES = 5000
MAX_LISTED = 50
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Top-level modules the kernel and the guest tools load from the sandbox environment.
KERNEL_MODULES = frozenset(
    {
        "IPython", "ipykernel", "ipykernel_launcher", "jupyter_client", "jupyter_core", "zmq", "traitlets",
        "tornado", "comm", "debugpy", "psutil", "jedi", "parso", "pygments", "prompt_toolkit", "decorator",
        "pexpect", "ptyprocess", "stack_data", "executing", "asttokens", "pure_eval", "wcwidth",
        "matplotlib_inline", "nest_asyncio", "nest_asyncio2", "platformdirs", "packaging", "dateutil",
        "cloudpickle", "coderunner_guest", "pip", "setuptools", "pkg_resources", "_distutils_hack",
        "PIL", "pypdf", "pypdfium2", "playwright", "greenlet", "pytesseract",
    }
)  # fmt: skip
SHADOWED = frozenset(sys.stdlib_module_names) | KERNEL_MODULES
#: What makes a file at the workspace's top importable as a module.
MODULE_SUFFIXES = (".py", ".pyc", ".so")


@dataclass
class StartupReport:
    disabled: list[str] = field(default_factory=list)
    inert_pth: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)
    shadowing: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object] | None:
        if not (self.disabled or self.inert_pth or self.packages or self.shadowing):
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
        if self.shadowing:
            report["shadowing"] = self.shadowing[:MAX_LISTED]
            report["shadowing_note"] = (
                "files at the top of /workspace named like a standard-library or kernel module; they do not "
                "run at start-up, but `import NAME` in your code may load the workspace's file: rename them"
            )
        return report


def _shadowing(top: int) -> list[str]:
    """Top-level modules or packages of the workspace (fd `top`) named like one in SHADOWED."""
    with os.scandir(top) as entries:
        names = [entry.name for _, entry in zip(range(MAX_ENTRIES), entries, strict=False)]
    found = []
    for name in sorted(names):
        stem, dot, suffix = name.partition(".")
        if stem not in SHADOWED:
            continue
        if dot and f".{suffix.rsplit('.', 1)[-1]}" in MODULE_SUFFIXES:
            found.append(name)
        elif not dot and stat.S_ISLNK(os.stat(name, dir_fd=top, follow_symlinks=False).st_mode):
            found.append(f"{name} (link)")  # Python follows it; the host does not look where it points
        elif not dot and _is_package(top, name):
            found.append(f"{name}/")
    return found


def _is_package(top: int, name: str) -> bool:
    """A folder (not a link) holding __init__.py: a regular package, which shadows (a bare folder does not)."""
    try:
        folder = os.open(name, DIR_FLAGS, dir_fd=top)
    except OSError:
        return False
    try:
        for init in ("__init__.py", "__init__.pyc"):
            with contextlib.suppress(OSError):
                os.stat(init, dir_fd=folder, follow_symlinks=False)
                return True
        return False
    finally:
        os.close(folder)


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
        report.shadowing = _shadowing(top)
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
