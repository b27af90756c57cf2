"""What every backend shares: the sandbox's fixed paths, its user, its environment and limits.

(Its workspace, its user and its /etc, which the host side writes too, are vocabulary/sandbox_layout.py's.)

One place for the facts all backends must agree on (the image built from the Containerfile uses
the same paths as the bwrap sandbox), so that a backend never imports another backend.
"""

from __future__ import annotations

from coderunner.sandbox.base import Limits, SandboxSpec
from coderunner.vocabulary.network import NetworkMode
from coderunner.vocabulary.sandbox_layout import HOME, WORKSPACE

#: The sandbox's Python environment (bwrap binds the host's venv here; the image has it here).
ENV_MOUNT = "/opt/coderunner/env"
IMAGE_PYTHON = f"{ENV_MOUNT}/bin/python"
#: The guest package (src/coderunner/guest) is bound read-only here as `coderunner_guest`.
GUEST_LIB = "/opt/coderunner/lib"
#: A session's own pip packages (install_packages), relative to its workspace; on the kernel's path.
SESSION_PACKAGES = ".coderunner/site-packages"
#: Network 'allowlist': the host's policy proxy listens on this socket in the sandbox's host-only,
#: read-only dir; the in-sandbox forwarder exposes it as 127.0.0.1:EGRESS_PORT.
EGRESS_SOCKET = "egress.sock"
EGRESS_PORT = 3128
#: Set in every sandbox (no CODERUNNER_ prefix: none of the host's own settings ever cross): the session's
#: package folder, which the guest puts on sys.path (and on
#: PYTHONPATH for the programs user code starts) only once its interpreter is up (guest/__init__.py).
SESSION_PACKAGES_ENV = "SESSION_SITE_PACKAGES"
#: Set in a sandbox with network 'none' (SandboxSpec.install_refusal): what the kernel's %pip answers.
INSTALL_REFUSAL_ENV = "SESSION_INSTALL_REFUSAL"
#: A bwrap sandbox's pid 1 (bwrap --as-pid-1; guest/sandbox_init.py): non-dumpable, held by the host's gate. Run
#: as `python -I -S -c SANDBOX_INIT_BOOT GATE_FD ...`: imported from the bytecode the host compiled
#: into the guest's folder once (bwrap.py's install_guest), its main called, never the script itself, which an
#: interpreter compiles from source at every run: about 1 ms of every sandbox's start, on the way to its
#: "ready". Only the guest's read-only folder goes on the path (-I keeps the workspace and PYTHON* off it).
SANDBOX_INIT_BOOT = (
    f"import os, sys; sys.path[:0] = [{GUEST_LIB!r}]; "
    "from coderunner_guest.sandbox_init import main; os._exit(main(sys.argv[1:]))"
)
#: Run as a script with -I -S: stdlib only, so no site-packages scan and no PYTHON* variables.
EGRESS_FORWARDER = f"{GUEST_LIB}/coderunner_guest/egress_forwarder.py"
#: A preload (NODE_OPTIONS) that points Node's fetch at the proxy: Node 20 has no NODE_USE_ENV_PROXY.
EGRESS_NODE_PRELOAD = f"{GUEST_LIB}/coderunner_guest/egress_node.cjs"
#: Where a kernel reads its connection file (its key) where the backend gives it privately (bwrap):
#: in its own sandbox's root, which no other sandbox of the session (its standby kernel) sees.
PRIVATE_CONNECTION = "/run/kernel/connection.json"
#: Size of the sandbox's /dev/shm.
SHM_MB = 64
#: /proc entries hidden entirely (as container runtimes do): kernel memory, keys, timers, hardware.
PROC_MASKED_FILES = ("kcore", "keys", "timer_list", "sched_debug", "latency_stats", "kallsyms", "kmsg")
PROC_MASKED_DIRS = ("acpi", "scsi")


def egress_environment(network: str) -> dict[str, str]:
    """Network 'allowlist': every HTTP client in the sandbox (pip, requests, urllib, httpx, curl, git,
    Node's fetch, Chromium) goes through the forwarder; a program that ignores proxies gets nothing."""
    if network != NetworkMode.ALLOWLIST:
        return {}
    url = f"http://127.0.0.1:{EGRESS_PORT}"
    env = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = url
    env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    env["NODE_USE_ENV_PROXY"] = "1"  # Node 24+ does it natively; the preload covers older ones
    env["NODE_OPTIONS"] = f"--require {EGRESS_NODE_PRELOAD}"
    env["CODERUNNER_EGRESS_PROXY"] = url  # guest/browser.py launches Chromium with it
    return env


def spec_environment(spec: SandboxSpec) -> dict[str, str]:
    """What a sandbox's own options add to its environment: the proxy ('allowlist'), the install refusal ('none')."""
    env = egress_environment(spec.network)
    if spec.install_refusal:
        env[INSTALL_REFUSAL_ENV] = spec.install_refusal
    return env


def egress_launcher(python: str, network: str, host_dir: str, argv: list[str]) -> list[str]:
    """`argv` behind the forwarder in network 'allowlist' (it starts, then execs argv); else argv."""
    if network != NetworkMode.ALLOWLIST:
        return argv
    return [python, "-I", "-S", EGRESS_FORWARDER, f"{host_dir}/{EGRESS_SOCKET}", str(EGRESS_PORT), "--", *argv]


def product_python(python: str, *args: str) -> list[str]:
    """The argv of every Python the product starts in a sandbox (kernel, one-shot launcher, vm_init).

    -P keeps the working directory (/workspace) and a script's folder off sys.path: a module planted
    there (ipykernel_launcher.py, json.py, runpy.py ...) would otherwise run before any user code. The
    guest adds '' back for user code once the interpreter is up (guest/__init__.py: user_paths).
    Not PYTHONSAFEPATH: the environment is inherited by the programs user code starts.
    """
    return [python, "-P", *args]


def sandbox_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of the kernel: nothing of the host's crosses (bwrap --clearenv)."""
    env = {
        "PATH": f"{ENV_MOUNT}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": HOME,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "SHELL": "/bin/sh",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TMPDIR": "/tmp",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        # glibc reserves 64 MiB of address space per thread arena; under RLIMIT_AS that is waste.
        "MALLOC_ARENA_MAX": "2",
        # Only read-only folders: what the sandbox writes is on no interpreter's path at start-up.
        "PYTHONPATH": GUEST_LIB,
        SESSION_PACKAGES_ENV: f"{WORKSPACE}/{SESSION_PACKAGES}",
    }
    env.update(extra or {})
    return env


def rlimit_prefix(limits: Limits, nproc: int | None, memory_cgroup: bool = False) -> list[str]:
    """RLIMIT_AS gives user code a clean MemoryError instead of the OOM killer; NPROC is the
    unprivileged fallback against fork bombs where no pids cgroup can be had.

    Where a memory cgroup bounds the sandbox, RLIMIT_AS is only a soft limit: Chromium reserves
    about a terabyte of address space and could not start under it, so the browser lifts the soft
    limit for itself while the cgroup still bounds what it really uses.
    """
    flags = []
    if limits.memory_mb is not None:
        soft = limits.memory_mb * 2**20
        flags.append(f"--as={soft}:unlimited" if memory_cgroup else f"--as={soft}")
    if nproc is not None:
        flags.append(f"--nproc={nproc}")
    return ["/usr/bin/prlimit", *flags, "--"] if flags else []


# --- gVisor checkpoints (gvisor.py, gvisor_checkpoint.py and guest/channel_relay.py agree on these) ---
#: Where a runsc-direct sandbox sees its run dir (writable) and host-only dir (read-only). Fixed paths,
#: not the host's own, so that a checkpoint taken in one session restores into another's dirs.
RUN_INSIDE = "/run/coderunner/run"
HOST_INSIDE = "/run/coderunner/host"
#: The checkpointable sandbox's init: relays the kernel's channels from host-visible sockets in the run
#: dir to the kernel's own ipc sockets in /tmp, and drops every host socket on SIGUSR1 (rebinds on
#: SIGUSR2). Run as a script with -I -S: stdlib only.
CHANNEL_RELAY = f"{GUEST_LIB}/coderunner_guest/channel_relay.py"
#: What the relay says in the run dir, replaced atomically: "<open|closed|failed> <generation>\n".
RELAY_STATE = "relay-state"
#: Most bytes the host reads of that file (it is the sandbox's to write).
RELAY_STATE_MAX_BYTES = 64
