"""Doctor's probes of the bwrap backend: bubblewrap and the namespaces it needs, the sandbox's Python
environment, and what this machine lets the server enforce (seccomp, cgroups, sizes, network)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from coderunner.sandbox import init_binary
from coderunner.sandbox.probes import PROBE_TIMEOUT_S, Check, Readiness
from coderunner.vocabulary.backends import install_hint
from coderunner.vocabulary.network import NetworkMode

if TYPE_CHECKING:
    from coderunner.config import Settings


def readiness(settings: Settings, name: str) -> Readiness:
    if not sys.platform.startswith("linux"):
        return "Linux only", None
    if shutil.which("bwrap") is None:
        return "bwrap is not installed", install_hint(name)
    if not (settings.sandbox_env / "bin" / "python").exists():
        return f"no sandbox environment at {settings.sandbox_env}", "coderunner setup"
    return None, None


def checks(settings: Settings, name: str) -> list[Check]:
    return [
        check_bwrap(), check_user_namespaces(), check_sandbox_env(settings), check_sandbox_init(settings),
        check_kernel_template(settings), check_start_namespace(settings), *check_containment(settings),
    ]  # fmt: skip


def check_sandbox_init(settings: Settings) -> Check:
    """Which pid 1 each sandbox gets (init_binary.py): a start's cost, never containment (one protocol, both)."""
    if not settings.compiled_init:
        return Check("sandbox init", True, "Python (compiled_init false): about 5 CPU-ms more a start")
    built = init_binary.installed(settings.sandbox_env)
    if built is None:
        return Check("sandbox init", True, "Python: no compiled init for this version in the sandbox environment "
                     "(about 5 CPU-ms more a start)", "install a C compiler (gcc), then coderunner setup")  # fmt: skip
    return Check("sandbox init", True, f"compiled ({built.name})")


def check_kernel_template(settings: Settings) -> Check:
    """Whether kernels are forks of the warm template (kernel_template): a start's cost, never containment."""
    from coderunner.sandbox.bwrap_template import template_unavailable

    if settings.kernel_template is False:
        return Check("kernel template", True, "off (kernel_template false): every kernel starts from nothing")
    why_not = template_unavailable()
    if why_not is None:
        return Check("kernel template", True, "on: each kernel is a fork of one warm template (a start in about a "
                     "third of a cold one's time and CPU)")  # fmt: skip
    return Check("kernel template", True, f"not here, kernels start cold: {why_not}")


def check_start_namespace(settings: Settings) -> Check:
    """Where bwrap starts (start_namespace.py): a start's cost beside held sessions, never containment."""
    if os.getuid() != 0:
        return Check("start namespace", True, "not needed: a server that is not root mounts nothing per session")
    if not settings.start_namespace:
        return Check("start namespace", True, "off (start_namespace false): each start reads every mount the host "
                     "holds, two a held session")  # fmt: skip
    if shutil.which("nsenter") is None:
        return Check("start namespace", True, "nsenter is missing: each start reads every mount the host holds, "
                     "two a held session", "sudo apt-get install util-linux")  # fmt: skip
    return Check("start namespace", True, "on: bwrap starts beside none of the held sessions' mounts")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def check_bwrap() -> Check:
    path = shutil.which("bwrap")
    if path is None:
        return Check("bubblewrap", False, "bwrap is not installed", install_hint("bwrap"))
    try:
        version = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        ).stdout.strip()
    except subprocess.TimeoutExpired:
        return Check("bubblewrap", False, f"{path} --version did not answer", None)
    return Check("bubblewrap", True, f"{version} at {path}")


def check_user_namespaces() -> Check:
    """Try the namespaces bwrap needs; on failure, name the sysctl or AppArmor rule in the way."""
    path = shutil.which("bwrap")
    if path is None:
        return Check("user namespaces", False, "not checked: bwrap is missing", install_hint("bwrap"))
    probe = [path, "--unshare-all", "--unshare-user", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
             "--symlink", "usr/lib", "/lib", "--proc", "/proc", "--dev", "/dev", "/usr/bin/true"]  # fmt: skip
    if Path("/lib64").is_symlink():
        probe[-1:-1] = ["--symlink", "usr/lib64", "/lib64"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return Check("user namespaces", False, "a bwrap probe did not finish", None)
    if done.returncode == 0:
        return Check("user namespaces", True, "bwrap can create user, pid, network and mount namespaces")
    detail = done.stderr.strip() or f"bwrap exited {done.returncode}"
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return Check(
            "user namespaces",
            False,
            f"{detail} (Ubuntu's AppArmor restricts unprivileged user namespaces)",
            "sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0  "
            "(or install an AppArmor profile that allows /usr/bin/bwrap userns)",
        )
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return Check("user namespaces", False, detail, "sudo sysctl -w kernel.unprivileged_userns_clone=1")
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return Check("user namespaces", False, detail, "sudo sysctl -w user.max_user_namespaces=15000")
    return Check("user namespaces", False, detail, None)


def check_sandbox_env(settings: Settings) -> Check:
    python = settings.sandbox_env / "bin" / "python"
    if not python.exists():
        return Check("sandbox environment", False, f"{settings.sandbox_env} is missing", "coderunner setup")
    try:
        done = subprocess.run(
            [str(python), "-c", "import ipykernel, numpy, pandas, matplotlib; print(ipykernel.__version__)"],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Check("sandbox environment", False, "its python did not answer", "coderunner setup --recreate")
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1:] or ["import failed"]
        return Check("sandbox environment", False, last[0], "coderunner setup")
    return Check("sandbox environment", True, f"{settings.sandbox_env} (ipykernel {done.stdout.strip()})")


def check_containment(settings: Settings) -> list[Check]:
    """Which limits this machine lets the server enforce, and what would enable the rest."""
    from coderunner.hostfs.workspaces import quota_problem
    from coderunner.sandbox.cgroups import CgroupManager, CgroupsUnavailable
    from coderunner.sandbox.seccomp import SeccompUnavailable, compiled_filter

    checks = []
    try:
        compiled_filter()
        checks.append(
            Check("seccomp", True, "filter compiled with libseccomp (ptrace, bpf, mount, unshare, ... denied)")
        )
    except SeccompUnavailable as exc:
        checks.append(Check("seccomp", False, str(exc), "sudo apt-get install libseccomp2"))
    if not settings.cgroups:
        checks.append(Check("cgroups", True, "disabled by configuration: memory by RLIMIT_AS only", degraded=True))
    else:
        try:
            manager = CgroupManager.detect()
            checks.append(Check("cgroups", True, f"v{manager.version}: per-session memory, pids and cpu limits"))
        except (CgroupsUnavailable, OSError) as exc:
            checks.append(
                Check(
                    "cgroups",
                    True,
                    f"not enforceable ({exc}); memory by RLIMIT_AS, processes by RLIMIT_NPROC, no CPU quota",
                    "run as root, or under a delegated cgroup: systemd-run --user --scope -p Delegate=yes ...",
                    degraded=True,
                )
            )
    problem = quota_problem() if settings.workspace_quota else "disabled by configuration"
    if problem is None:
        checks.append(Check("workspace size cap", True, f"loop-mounted ext4, {settings.disk_mb} MiB per session"))
    else:
        checks.append(Check("workspace size cap", True, f"not enforced: {problem}", degraded=True))
    chromium = Path("/usr/lib/chromium/chromium")
    if chromium.exists():
        checks.append(Check("browser", True, f"Chromium at {chromium} (runs inside the sandbox)"))
    else:
        checks.append(Check("browser", True, "Chromium missing: browser tools unavailable",
                            "sudo apt-get install chromium", degraded=True))  # fmt: skip
    if shutil.which("tesseract"):
        checks.append(Check("ocr", True, "Tesseract available for image_ops ocr"))
    else:
        checks.append(Check("ocr", True, "Tesseract missing: image_ops ocr unavailable",
                            "sudo apt-get install tesseract-ocr tesseract-ocr-eng", degraded=True))  # fmt: skip
    if settings.network_ceiling != NetworkMode.INTERNET:  # above the user's ceiling: nothing to check or suggest
        return checks
    if shutil.which("slirp4netns"):
        checks.append(Check("network 'internet' mode", True, "slirp4netns available (off unless asked for)"))
    else:
        fix = "sudo apt-get install slirp4netns"
        checks.append(Check("network 'internet' mode", True, "unavailable: slirp4netns missing", fix, degraded=True))
    return checks
