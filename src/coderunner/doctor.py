"""`coderunner doctor`: what would stop the sandbox working here, and the command that fixes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from coderunner.config import Settings
from coderunner.egress.ceiling import NetworkMode, modes_within
from coderunner.egress.policy import PRESETS
from coderunner.egress.texts import ceiling_summary
from coderunner.sandbox import SandboxUnavailable, make_backend
from coderunner.sessions import SessionManager

PROBE_TIMEOUT_S = 30


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    #: A warning: works, but with less containment than the machine could give.
    degraded: bool = False


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def check_bwrap() -> Check:
    path = shutil.which("bwrap")
    if path is None:
        return Check("bubblewrap", False, "bwrap is not installed", "sudo apt-get install bubblewrap")
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
        return Check("user namespaces", False, "not checked: bwrap is missing", "sudo apt-get install bubblewrap")
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


async def check_sandboxed_run(settings: Settings) -> Check:
    try:
        backend = make_backend(settings)
    except SandboxUnavailable as exc:
        return Check("sandboxed 1+1", False, str(exc), None)
    began = time.monotonic()
    try:
        with anyio.fail_after(settings.startup_timeout_s + 10):
            # One check, one session: no warm pool to start beside it.
            async with SessionManager(settings.model_copy(update={"pool_size": 0}), backend) as manager:
                session = await manager.resolve(None)
                result = await session.run("1+1", 10, None)
    except Exception as exc:
        return Check("sandboxed 1+1", False, f"{type(exc).__name__}: {exc}", None)
    text = result.outcome.output.text().strip()
    if result.is_error or text != "2":
        return Check("sandboxed 1+1", False, f"unexpected answer: {text!r}", None)
    return Check("sandboxed 1+1", True, f"= 2 in a fresh sandbox ({time.monotonic() - began:.2f}s cold)")


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


def check_network_ceiling(settings: Settings) -> Check:
    """The most network an agent may ask for, and where the user sets it."""
    ceiling = settings.network_ceiling
    why = "max_network" if settings.max_network is not None else "what network and allowed_domains turn on"
    return Check(
        "network ceiling",
        True,
        f"{ceiling} ({why}): agents may ask for {' or '.join(modes_within(ceiling))}, never more; you raise it "
        "with max_network (and name hosts for 'allowlist' in allowed_domains)",
    )


def check_network_allowlist(settings: Settings) -> Check:
    """Whether this backend enforces network 'allowlist', and the hosts the user allows (the ceiling)."""
    name = "network 'allowlist' mode"
    try:
        backend = make_backend(settings)
    except SandboxUnavailable as exc:
        return Check(name, True, f"not checked: {exc}", degraded=True)
    problem = backend.network_problem(NetworkMode.ALLOWLIST)
    if problem:
        return Check(name, True, f"refused on {backend.name}: {problem}", degraded=True)
    where = f"enforced on {backend.name} (loopback only inside; out through a per-session host proxy)"
    ceiling = ceiling_summary(settings.allowed_domains, settings.allowed_ports)
    return Check(name, True, f"{where}; allowed_domains: {ceiling}; presets: {', '.join(PRESETS)}")


BACKENDS = ("bwrap", "podman", "docker", "gvisor", "apple")


def check_backend_choice(settings: Settings) -> Check:
    """Which backend sessions use, and why that one."""
    if "backend" in settings.model_fields_set:
        why = "chosen by the configuration (backend / CODERUNNER_BACKEND / --backend)"
    elif sys.platform.startswith("linux"):
        why = "the Linux default: no daemon, no image"
    elif sys.platform == "darwin" and settings.backend == "apple":
        why = "the macOS default: Apple `container` is installed (one VM per session)"
    else:
        why = "the first container engine found (Apple `container` is not installed)"
    return Check("backend", True, f"{settings.backend}: {why}")


def _engine_problem(settings: Settings, kind: str) -> tuple[str | None, str | None]:
    """(what is missing for backend `kind` here, the fix), or (None, None) when it looks ready."""
    from coderunner.sandbox.engine import QUERY_TIMEOUT_S, EngineError, engine_env, run_sync

    if kind == "bwrap":
        if not sys.platform.startswith("linux"):
            return "Linux only", None
        if shutil.which("bwrap") is None:
            return "bwrap is not installed", "sudo apt-get install bubblewrap"
        if not (settings.sandbox_env / "bin" / "python").exists():
            return f"no sandbox environment at {settings.sandbox_env}", "coderunner setup"
        return None, None
    if kind == "apple" and sys.platform != "darwin":
        return "macOS 26 on Apple silicon only", None
    if kind == "gvisor":  # podman's image (built and mounted by podman), run by runsc directly
        if not sys.platform.startswith("linux"):
            return "Linux only", None
        if os.getuid() != 0:
            return "runs runsc directly (memory checkpoints) and needs a root server", "run the server as root"
        if shutil.which("runsc") is None:
            return "runsc (gVisor) is not installed", "sudo apt-get install runsc"
    cli = {"apple": "container", "gvisor": "podman"}.get(kind, kind)
    path = shutil.which(cli)
    if path is None:
        fix = {
            "apple": "macOS 26 on Apple silicon: ./install.sh installs it",
            "podman": "sudo apt-get install podman runc (Linux), or Podman Desktop",
            "gvisor": "sudo apt-get install podman runc runsc",
            "docker": "install Docker Engine or Docker Desktop",
        }[kind]
        return f"`{cli}` is not installed", fix
    if kind == "apple":
        if (refused := _apple_version(path)[1]) is not None:
            return refused
        try:
            status = run_sync(
                [path, "system", "status"], QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ))
            )
        except EngineError as exc:
            return f"`container system status` does not answer ({exc})", None
        if status.returncode != 0:
            return "the container system service is not running", "container system start --enable-kernel-install"
        query = [path, "image", "inspect", settings.image]
    else:
        runtime = ["--runtime", settings.oci_runtime] if kind == "podman" and settings.oci_runtime else []
        query = [path, *runtime, "image", "inspect", "--format", "{{.Id}}", settings.image]
    try:
        done = run_sync(query, QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ)))
    except EngineError as exc:
        return f"{cli} does not answer ({exc})", None
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        # Apple `container` 0.x says `notFound: "images: NAME"` (ImageInspect.swift), 1.x "image not found".
        if any(word in said[0].lower() for word in ("no such", "not known", "not found", "notfound")):
            return f"image {settings.image} not built", f"coderunner setup --backend {kind}"
        return f"{cli} does not answer: {said[0][:200]}", None
    return None, None


def check_other_backends(settings: Settings) -> list[Check]:
    """What each backend not in use would need here (information, never a failure)."""
    checks = []
    for kind in BACKENDS:
        if kind == settings.backend:
            continue
        missing, fix = _engine_problem(settings, kind)
        detail = "ready" if missing is None else f"unavailable: {missing}"
        checks.append(Check(f"other backend {kind}", True, detail, fix, degraded=missing is not None and bool(fix)))
    return checks


def _apple_version(path: str) -> tuple[str, tuple[str, str | None] | None]:
    """(`container`'s version and whether it is supported, or (problem, fix) when it is refused)."""
    from coderunner.sandbox.apple import UPGRADE_HINT, ContainerVersion, version_caveat, version_problem
    from coderunner.sandbox.engine import QUERY_TIMEOUT_S, EngineError, engine_env, run_sync

    try:
        done = run_sync([path, "--version"], QUERY_TIMEOUT_S, check=False, env=engine_env(dict(os.environ)))
        version = ContainerVersion.parse(done.stdout)
    except EngineError:
        version = None
    if (problem := version_problem(version)) is not None:
        return "", (problem, UPGRADE_HINT)
    assert version is not None
    caveat = version_caveat(version)
    return f"Apple container {version} ({'supported' if caveat is None else caveat})", None


def _apple_channels(settings: Settings) -> Check:
    """The TCP fallback, told as it is: not loopback-only, and it needs the container network."""
    if settings.kernel_channels != "tcp":
        return Check("apple kernel channels", True, "ipc: kernel sockets relayed over vsock, the VM has no network")
    return Check(
        "apple kernel channels",
        True,
        "tcp: kernel ports are published on the host's 127.0.0.1 and are also reachable at the VM's address "
        "from this Mac and from other containers on the container network; every session gets the container "
        "network (internet). macOS may ask to let `container` find devices on the Local Network: until that is "
        "allowed, publishing can fail",
        'kernel_channels = "ipc" (the default) needs no network at all',
        degraded=True,
    )


def check_container_backend(settings: Settings) -> list[Check]:
    missing, fix = _engine_problem(settings, settings.backend)
    if missing is not None:
        return [Check(f"{settings.backend} backend", False, missing, fix)]
    if settings.backend != "apple":
        return [Check(f"{settings.backend} backend", True, f"engine found, image {settings.image} built")]
    path = shutil.which("container") or "container"
    version, _ = _apple_version(path)
    caveat = "supported" not in version
    from coderunner.sandbox.apple import UPGRADE_HINT

    return [
        Check("apple backend", True, f"{version}, image {settings.image} built", UPGRADE_HINT, degraded=caveat),
        _apple_channels(settings),
    ]


def run_checks(settings: Settings) -> list[Check]:
    checks = [check_backend_choice(settings)]
    if settings.backend == "bwrap":
        checks += [check_bwrap(), check_user_namespaces(), check_sandbox_env(settings), *check_containment(settings)]
    else:
        checks += check_container_backend(settings)
    checks.append(check_network_ceiling(settings))
    if NetworkMode.ALLOWLIST in modes_within(settings.network_ceiling):
        checks.append(check_network_allowlist(settings))
    if all(check.ok for check in checks):
        checks.append(anyio.run(check_sandboxed_run, settings))
    return [*checks, *check_other_backends(settings)]


def report(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        mark = "FAIL" if not check.ok else ("warn" if check.degraded else "ok  ")
        lines.append(f"[{mark}] {check.name}: {check.detail}")
        if (not check.ok or check.degraded) and check.fix:
            lines.append(f"       fix: {check.fix}")
    if os.getuid() == 0:
        lines.append("note: running as root; each sandbox runs as an unprivileged host uid of its own, never as root")
    return "\n".join(lines)
