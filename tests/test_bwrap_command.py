"""The exact bwrap flags: what the sandbox is made of, and what it must never be given."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from coderunner.sandbox.base import Limits, SandboxSpec
from coderunner.sandbox.bwrap import BwrapCommand
from coderunner.sandbox.bwrap_argv import HOLD, root_files
from coderunner.sandbox.common import ENV_MOUNT, INSTALL_REFUSAL_ENV, SANDBOX_INIT_BOOT, sandbox_environment


def build(tmp_path: Path, limits: Limits | None = None, **fds: int | str) -> list[str]:
    spec = SandboxSpec(
        name="abcd1234",
        workspace=tmp_path / "ws",
        runtime_dir=tmp_path / "run",
        host_dir=tmp_path / "host",
        limits=limits or Limits(),
    )
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=Path("/opt/env"))
    fds.setdefault("gate_fd", 9)
    return command.argv(spec, ["python", "-m", "ipykernel_launcher"], **fds)  # type: ignore[arg-type]


def pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == flag]


def test_namespaces_privileges_and_lifetime(tmp_path: Path) -> None:
    argv = build(tmp_path)
    for flag in ("--unshare-all", "--unshare-user", "--as-pid-1", "--new-session", "--clearenv",
                 "--disable-userns"):  # fmt: skip
        assert flag in argv
    # The sandbox's end is the host's business (pidfds, the watcher), not a death signal in its pid 1.
    assert "--die-with-parent" not in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert argv[argv.index("--uid") + 1] == "1000"
    assert argv[argv.index("--remount-ro") + 1] == "/"
    assert "--share-net" not in argv


def test_only_system_files_env_workspace_and_runtime_are_bound(tmp_path: Path) -> None:
    argv = build(tmp_path)
    writable = pairs(argv, "--bind")
    assert writable == [(str(tmp_path / "run"), str(tmp_path / "run")), (str(tmp_path / "ws"), "/workspace")]
    read_only = dict((dest, src) for src, dest in pairs(argv, "--ro-bind"))
    assert read_only["/usr"] == "/usr" and read_only[ENV_MOUNT] == "/opt/env"
    assert "/etc/passwd" not in read_only  # the sandbox's own, copied into its root (root_files), never bound
    # What the host writes for the sandbox (connection files, one-shot inputs) is read-only inside.
    assert read_only[str(tmp_path / "host")] == str(tmp_path / "host")
    sources = {src for src, _ in pairs(argv, "--ro-bind")}
    assert not {"/", "/home", "/root", "/etc", "/etc/shadow", "/etc/passwd", "/tmp", "/run"} & sources


def test_environment_is_explicit_and_host_free(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "leak-me")
    argv = build(tmp_path)
    set_env = dict(pairs(argv, "--setenv"))
    assert set_env == sandbox_environment()
    assert "leak-me" not in " ".join(argv)
    assert set_env["HOME"] == "/tmp/home" and set_env["PATH"].startswith(ENV_MOUNT)


def test_memory_limit_wraps_the_inner_command(tmp_path: Path) -> None:
    """Under the init (which no limit of user code binds), before the program."""
    argv = build(tmp_path, Limits(memory_mb=512), nproc=300)
    inner = argv[argv.index("--") + 8 :]
    assert inner[:4] == ["/usr/bin/prlimit", f"--as={512 * 1024 * 1024}", "--nproc=300", "--"]
    assert inner[4:] == ["python", "-m", "ipykernel_launcher"]
    unlimited = build(tmp_path)
    assert unlimited[unlimited.index("--") + 8 :] == ["python", "-m", "ipykernel_launcher"]


def test_seccomp_tmpfs_sizes_and_setup_fds(tmp_path: Path) -> None:
    argv = build(tmp_path, Limits(tmp_mb=100), seccomp_fd=7, info_fd=8, block_fd=9)
    assert argv[argv.index("--seccomp") + 1] == "7"
    assert argv[argv.index("--info-fd") + 1] == "8" and argv[argv.index("--block-fd") + 1] == "9"
    sized = [(argv[i + 1], argv[i + 3]) for i, arg in enumerate(argv) if arg == "--size"]
    assert sized == [(str(100 * 2**20), "/tmp"), (str(64 * 2**20), "/dev/shm")]


def test_seccomp_filter_compiles_and_denies_the_escape_hatches() -> None:
    from coderunner.sandbox.seccomp import DENIED_SYSCALLS, compiled_filter

    program = compiled_filter()
    assert len(program) > 0 and len(program) % 8 == 0, "a BPF program is a list of 8-byte instructions"
    for name in ("ptrace", "bpf", "keyctl", "unshare", "mount", "perf_event_open", "userfaultfd", "setns"):
        assert name in DENIED_SYSCALLS


def test_network_waits_for_the_sandboxs_own_loopback_first() -> None:
    """slirp4netns must not bring `lo` up before bwrap has (bwrap would then die on RTM_NEWADDR)."""
    import subprocess

    import anyio

    from coderunner.sandbox.bwrap import _loopback_ready

    assert anyio.run(_loopback_ready, os.getpid(), 5.0)  # the host's namespace has 127.0.0.1
    if os.getuid() != 0:
        return
    # A namespace whose loopback is still down has no 127.0.0.1: the wait ends at its bound, saying so.
    fresh = subprocess.Popen(["unshare", "--net", "sleep", "30"])
    try:
        own = os.readlink("/proc/self/ns/net")
        for _ in range(500):  # until unshare has entered its new namespace (bounded)
            if os.readlink(f"/proc/{fresh.pid}/ns/net") != own:
                break
            anyio.run(anyio.sleep, 0.01)
        assert not anyio.run(_loopback_ready, fresh.pid, 0.3)
        subprocess.run(["nsenter", "-t", str(fresh.pid), "-n", "ip", "link", "set", "lo", "up"], check=True, timeout=10)
        assert anyio.run(_loopback_ready, fresh.pid, 5.0)
    finally:
        fresh.kill()
        fresh.wait()


def test_a_network_none_sandbox_is_told_why_nothing_installs_and_no_other_is(tmp_path: Path) -> None:
    """The host's own refusal (the user's ceiling's way out) reaches the kernel's %pip as a variable."""
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=Path("/opt/env"))
    told = SandboxSpec(name="a", workspace=tmp_path, runtime_dir=tmp_path, host_dir=tmp_path, install_refusal="why")
    untold = SandboxSpec(name="b", workspace=tmp_path, runtime_dir=tmp_path, host_dir=tmp_path, network="internet")
    assert dict(pairs(command.argv(told, ["python"], gate_fd=9), "--setenv"))[INSTALL_REFUSAL_ENV] == "why"
    assert INSTALL_REFUSAL_ENV not in dict(pairs(command.argv(untold, ["python"], gate_fd=9), "--setenv"))


def test_own_files_are_read_from_fds_into_the_sandboxs_own_root(tmp_path: Path) -> None:
    """Its /etc files and a kernel's connection file (its key): copied by bwrap from an fd, read-only, never a
    bind of a host path that another sandbox of the session binds too, and no mount at all (each costs a start a
    walk of the host's mount table); placed before the root goes read-only."""
    spec = SandboxSpec(
        name="abcd1234", workspace=tmp_path / "ws", runtime_dir=tmp_path / "run", host_dir=tmp_path / "host",
        private_files=(("/run/kernel/connection.json", b"{}"),),
    )  # fmt: skip
    files = root_files(spec)
    assert [path for path, _ in files] == [
        "/etc/passwd", "/etc/group", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/kernel/connection.json",
    ]  # fmt: skip
    assert dict(files)["/etc/passwd"].startswith(b"sandbox:x:1000:1000:")
    assert dict(files)["/etc/resolv.conf"] == b""  # no network: no name server
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=Path("/opt/env"))
    argv = command.argv(spec, ["python"], gate_fd=9, root_fds=tuple((7 + i, path) for i, (path, _) in enumerate(files)))
    assert pairs(argv, "--file") == [(str(7 + i), path) for i, (path, _) in enumerate(files)]
    assert all(argv[i - 2 : i] == ["--perms", "0444"] for i, arg in enumerate(argv) if arg == "--file")
    assert max(i for i, arg in enumerate(argv) if arg == "--file") < argv.index("--remount-ro")
    assert "--ro-bind-data" not in argv and "--bind-data" not in argv
    assert SandboxSpec(name="k", workspace=tmp_path, runtime_dir=tmp_path, host_dir=tmp_path).twin().twin().name == "k"


def test_pid_1_is_our_sealed_init_holding_the_gate_and_no_mark(tmp_path: Path) -> None:
    """bwrap's own pid 1 is dumpable by the sandbox's uid (issue 38): ours (guest/sandbox_init.py) comes
    first after `--`, waits on the gate fd, and nothing in any command line names the host's watcher."""
    argv = build(tmp_path, gate_fd=11)
    inner = argv[argv.index("--") + 1 :]
    assert inner[:7] == [f"{ENV_MOUNT}/bin/python", "-I", "-S", "-c", SANDBOX_INIT_BOOT, "11", "--"]
    assert inner[7:] == ["python", "-m", "ipykernel_launcher"]
    assert "--unsetenv" not in argv and not any("CODERUNNER" in arg for arg in argv if "=" not in arg)


def test_the_compiled_init_where_setup_built_one_is_pid_1_as_the_sandbox_sees_it(tmp_path: Path) -> None:
    """The compiled init (guest/sandbox_init.c) lives in the environment, which the sandbox sees at ENV_MOUNT: its
    path inside, then the gate, then the program, as for the Python one."""
    env_dir = Path("/opt/env")
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=env_dir, init_binary=env_dir / "libexec" / "sandbox-init-x")
    spec = SandboxSpec(name="k", workspace=tmp_path, runtime_dir=tmp_path, host_dir=tmp_path)
    argv = command.argv(spec, ["python", "-m", "ipykernel_launcher"], gate_fd=11)
    inner = argv[argv.index("--") + 1 :]
    assert inner == [f"{ENV_MOUNT}/libexec/sandbox-init-x", "11", "--", "python", "-m", "ipykernel_launcher"]
    assert command.argv(spec, HOLD, gate_fd=12)[-3:] == [f"{ENV_MOUNT}/libexec/sandbox-init-x", "12", "--hold"]


def test_a_sandbox_with_no_program_is_held_by_its_init_and_not_in_allowlist(tmp_path: Path) -> None:
    """HOLD (what a template's fork enters): the init says ready itself; no prlimit or shell before anything runs.
    In network 'allowlist' the forwarder must start a program, so there is none to hold."""
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=Path("/opt/env"))
    spec = SandboxSpec(
        name="k", workspace=tmp_path, runtime_dir=tmp_path, host_dir=tmp_path, limits=Limits(memory_mb=512)
    )
    argv = command.argv(spec, HOLD, gate_fd=11, nproc=64)
    assert argv[argv.index("--") + 1 :] == [
        f"{ENV_MOUNT}/bin/python", "-I", "-S", "-c", SANDBOX_INIT_BOOT, "11", "--hold",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="allowlist"):
        command.argv(dataclasses.replace(spec, network="allowlist"), HOLD, gate_fd=11)
