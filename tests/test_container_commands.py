"""The exact argv of every podman and docker operation, and of the image builds (Apple `container`'s
own argv, per version, is in test_apple_commands.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coderunner.config import Settings, default_backend
from coderunner.sandbox.base import Limits, SandboxSpec
from coderunner.sandbox.container import (
    channel_ports,
    connection_info,
    container_name,
    name_prefix,
    server_tag,
    session_key,
    with_guest_connection,
)
from coderunner.sandbox.image_build import BuildCommand, sources_digest
from coderunner.sandbox.oci import OciCommand, parse_server_containers
from coderunner.vocabulary.mounts import Mount

ENV_FLAGS = [
    "--env", "PATH=/opt/coderunner/env/bin:/usr/local/bin:/usr/bin:/bin",
    "--env", "HOME=/tmp/home",
    "--env", "USER=sandbox",
    "--env", "LOGNAME=sandbox",
    "--env", "SHELL=/bin/sh",
    "--env", "LANG=C.UTF-8",
    "--env", "LC_ALL=C.UTF-8",
    "--env", "TMPDIR=/tmp",
    "--env", "MPLBACKEND=module://matplotlib_inline.backend_inline",
    "--env", "PYTHONDONTWRITEBYTECODE=1",
    "--env", "PYDEVD_DISABLE_FILE_VALIDATION=1",
    "--env", "MALLOC_ARENA_MAX=2",
    "--env", "PYTHONPATH=/opt/coderunner/lib",
    "--env", "SESSION_SITE_PACKAGES=/workspace/.coderunner/site-packages",
]  # fmt: skip


def spec(**overrides: object) -> SandboxSpec:
    values: dict[str, object] = {
        "name": "9f8e7d6c",
        "workspace": Path("/srv/w/9f8e7d6c"),
        "runtime_dir": Path("/tmp/cr/9f8e7d6c/run"),
        "host_dir": Path("/tmp/cr/9f8e7d6c/host"),
        "limits": Limits(memory_mb=2048, cpus=1.5, pids=256, tmp_mb=512),
        "network": "none",
        "mounts": (Mount(Path("/home/ann/data"), "/data", False), Mount(Path("/home/ann/out"), "/out", True)),
    }
    values.update(overrides)
    return SandboxSpec(**values)  # type: ignore[arg-type]


KERNEL = ["/opt/coderunner/env/bin/python", "-m", "ipykernel_launcher", "-f", "/tmp/cr/9f8e7d6c/run/kernel-0.json"]


# --- podman and docker ---------------------------------------------------------------------------------


def test_podman_run_argv_is_exactly_the_hardened_one() -> None:
    command = OciCommand(
        engine="/usr/bin/podman", kind="podman", image="coderunner-sandbox:0.1.0", server="1a2b3c4d",
        runtime="runc", user="999:995", nofile=4096, nproc=4096, seccomp_profile=Path("/tmp/cr/seccomp-1.json"),
        instance="0123456789abcdef",
    )  # fmt: skip
    argv = command.run(spec(), KERNEL, "coderunner-1a2b3c4d-9f8e7d6c-a1b2c3")
    assert argv == [
        "/usr/bin/podman", "--runtime", "runc", "run", "--rm", "--init",
        "--name", "coderunner-1a2b3c4d-9f8e7d6c-a1b2c3",
        "--label", "coderunner.session=9f8e7d6c",
        "--label", "coderunner.server=1a2b3c4d",
        "--label", "coderunner.instance=0123456789abcdef",
        "--pull", "never",
        "--hostname", "sandbox",
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
        "--security-opt", "seccomp=/tmp/cr/seccomp-1.json",
        "--read-only",
        "--tmpfs", "/tmp:rw,nosuid,nodev,size=512m,mode=1777",
        "--shm-size", "64m",
        "--ulimit", "nofile=4096:4096",
        "--ulimit", "nproc=4096:4096",
        "--http-proxy=false",
        "--security-opt", "mask=/sys:/proc/kcore:/proc/keys:/proc/timer_list:/proc/sched_debug:/proc/latency_stats:"
                          "/proc/kallsyms:/proc/kmsg:/proc/acpi:/proc/scsi",
        "--network", "none",
        "--memory", "2048m", "--memory-swap", "2048m",
        "--cpus", "1.5",
        "--pids-limit", "256",
        "--user", "999:995",
        "--mount", "type=bind,source=/tmp/cr/9f8e7d6c/run,target=/tmp/cr/9f8e7d6c/run",
        "--mount", "type=bind,source=/tmp/cr/9f8e7d6c/host,target=/tmp/cr/9f8e7d6c/host,readonly",
        "--mount", "type=bind,source=/srv/w/9f8e7d6c,target=/workspace",
        "--mount", "type=bind,source=/home/ann/data,target=/data,readonly",
        "--mount", "type=bind,source=/home/ann/out,target=/out",
        "--workdir", "/workspace",
        *ENV_FLAGS,
        "coderunner-sandbox:0.1.0", *KERNEL,
    ]  # fmt: skip


def test_our_own_hosts_and_resolv_conf_cover_the_engines_copies() -> None:
    command = OciCommand(engine="podman", kind="podman", image="img", server="s")
    argv = command.run(spec(mounts=()), ["true"], "n", etc_dir=Path("/tmp/cr/9f8e7d6c/host/etc"))
    mounts = [argv[i + 1] for i, flag in enumerate(argv) if flag == "--mount"]
    assert mounts[-2:] == [
        "type=bind,source=/tmp/cr/9f8e7d6c/host/etc/hosts,target=/etc/hosts,readonly",
        "type=bind,source=/tmp/cr/9f8e7d6c/host/etc/resolv.conf,target=/etc/resolv.conf,readonly",
    ]


def test_docker_takes_runtime_per_run_and_has_no_podman_only_flags() -> None:
    command = OciCommand(engine="docker", kind="docker", image="img", server="s", runtime="runsc")
    argv = command.run(spec(limits=Limits()), ["true"], "n")
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[argv.index("--runtime") + 1] == "runsc"
    assert "--http-proxy=false" not in argv and "--userns=keep-id" not in argv
    assert not any(arg.startswith("mask=") for arg in argv), "docker's CLI has no mask option"
    assert "coderunner.instance" not in " ".join(argv), "no instance label unless the backend gives one"
    assert not any(flag in argv for flag in ("--memory", "--cpus", "--pids-limit", "--user"))
    assert command.remove("n") == ["docker", "rm", "--force", "n"]


def test_rootless_podman_keeps_the_users_id() -> None:
    command = OciCommand(engine="podman", kind="podman", image="img", server="s", user="1000:1000", keep_id=True)
    argv = command.run(spec(), ["true"], "n")
    assert argv[argv.index("--userns=keep-id") + 1 : argv.index("--userns=keep-id") + 3] == ["--user", "1000:1000"]


def test_internet_mode_uses_the_engines_network_and_tcp_publishes_on_loopback_only() -> None:
    command = OciCommand(engine="podman", kind="podman", image="img", server="s")
    internet = command.run(spec(network="internet"), ["true"], "n")
    assert "--network" not in internet and "--publish" not in internet
    tcp = command.run(spec(network="internet"), ["true"], "n", tcp_ports=[5001, 5002])
    published = [tcp[i + 1] for i, flag in enumerate(tcp) if flag == "--publish"]
    assert published == ["127.0.0.1:5001:5001", "127.0.0.1:5002:5002"]


def test_podman_operations_argv() -> None:
    command = OciCommand(engine="podman", kind="podman", image="img:1", server="1a2b3c4d", runtime="runc")
    assert command.remove("c") == ["podman", "--runtime", "runc", "rm", "--force", "--time", "0", "c"]
    assert command.inspect_pid("c") == ["podman", "--runtime", "runc", "inspect", "--format", "{{.State.Pid}}", "c"]
    assert command.image_exists() == [
        "podman", "--runtime", "runc", "image", "inspect", "--format", '{{index .Config.Labels "coderunner.sources"}}',
        "img:1",
    ]  # fmt: skip
    assert command.list_server() == [
        "podman", "--runtime", "runc", "ps", "--all", "--filter", "label=coderunner.server=1a2b3c4d",
        "--format", '{{.Names}} {{index .Labels "coderunner.session"}}',
    ]  # fmt: skip


def test_a_mount_path_with_a_comma_is_refused_not_misparsed() -> None:
    from coderunner.sandbox.container import ContainerUnavailable

    command = OciCommand(engine="podman", kind="podman", image="img", server="s")
    with pytest.raises(ContainerUnavailable, match="comma"):
        command.run(spec(mounts=(Mount(Path("/a,b"), "/x", False),)), ["true"], "n")


def test_seccomp_profile_refuses_what_bwrap_refuses_and_keeps_the_engines_rules() -> None:
    from coderunner.sandbox.seccomp import DENIED_SYSCALLS, tightened_profile

    engine = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [
            {"names": ["read", "ptrace", "keyctl"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["mount"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 2114060288, "op": "SCMP_CMP_MASKED_EQ"}]},
        ],
    }  # fmt: skip
    profile = tightened_profile(engine)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["syscalls"][0] == {"names": ["read"], "action": "SCMP_ACT_ALLOW"}
    assert profile["syscalls"][1] == {"names": sorted(set(DENIED_SYSCALLS)), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    assert engine["syscalls"][2] not in profile["syscalls"], "clone is ruled by our rules alone (unit/test_seccomp.py)"
    assert engine["syscalls"][0]["names"] == ["read", "ptrace", "keyctl"], "the engine's profile is not changed"


def test_server_container_listing_is_parsed() -> None:
    output = "coderunner-1a2b3c4d-9f8e7d6c-a1b2c3 9f8e7d6c\ncoderunner-1a2b3c4d-0badc0de-445566 0badc0de\n\nodd\n"
    assert parse_server_containers(output) == [
        ("coderunner-1a2b3c4d-9f8e7d6c-a1b2c3", "9f8e7d6c"),
        ("coderunner-1a2b3c4d-0badc0de-445566", "0badc0de"),
    ]


def test_names_keys_and_tags() -> None:
    assert session_key(spec()) == "9f8e7d6c"
    assert session_key(spec(name="abc", runtime_dir=Path("/tmp/cr/abc/run"))) == "abc"
    assert server_tag(Path("/tmp/cr")) == server_tag(Path("/tmp/cr")) != server_tag(Path("/tmp/other"))
    name = container_name("1a2b3c4d", "9f8e7d6c")
    assert name.startswith(name_prefix("1a2b3c4d", "9f8e7d6c"))
    assert len(name) == len("coderunner-1a2b3c4d-9f8e7d6c-") + 6
    assert container_name("t", "s") != container_name("t", "s"), "a restart never collides with a dying container"


# --- the kernel's connection file as seen inside -------------------------------------------------------


def test_guest_connection_file_changes_only_the_address(tmp_path: Path) -> None:
    host_file = tmp_path / "kernel-0.json"
    info = {"transport": "tcp", "ip": "127.0.0.1", "shell_port": 5001, "iopub_port": 5002, "stdin_port": 5003,
            "control_port": 5004, "hb_port": 5005, "key": "k", "signature_scheme": "hmac-sha256"}  # fmt: skip
    host_file.write_text(json.dumps(info))
    os.chmod(host_file, 0o600)
    argv = ["python", "-m", "ipykernel_launcher", "-f", str(host_file), "--quiet"]
    assert channel_ports(connection_info(argv)) == [5001, 5002, 5003, 5004, 5005]
    inner = with_guest_connection(argv, "0.0.0.0")
    guest = tmp_path / "kernel-0.guest.json"
    assert inner == ["python", "-m", "ipykernel_launcher", "-f", str(guest), "--quiet"]
    assert json.loads(guest.read_text()) == {**info, "ip": "0.0.0.0"}
    assert guest.stat().st_mode & 0o777 == 0o600
    assert with_guest_connection(argv, "/run/x", "/vm/dir")[4] == "/vm/dir/kernel-0.guest.json"


# --- image builds and settings -------------------------------------------------------------------------


def test_build_argv_per_engine() -> None:
    context = Path("/src/coderunner")
    podman = BuildCommand(kind="podman", engine="podman", image="img:1", context=context, digest="d",
                          base_image="localhost/base:bookworm", runtime="runc",
                          ca_bundle=Path("/etc/ssl/certs/ca-certificates.crt"))  # fmt: skip
    assert podman.argv() == [
        "podman", "--runtime", "runc", "build", "--tag", "img:1", "--file", "/src/coderunner/Containerfile",
        "--build-arg", "BASE_IMAGE=localhost/base:bookworm", "--label", "coderunner.sources=d",
        "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
        "--secret", "id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt", "/src/coderunner",
    ]  # fmt: skip
    apple = BuildCommand(kind="apple", engine="container", image="img:1", context=context, digest="d")
    assert apple.argv() == [
        "container", "build", "--tag", "img:1", "--file", "/src/coderunner/Containerfile",
        "--label", "coderunner.sources=d", "/src/coderunner",
    ]  # fmt: skip
    docker = BuildCommand(kind="docker", engine="docker", image="img:1", context=context, digest="d")
    assert "--runtime" not in docker.argv() and "nproc=4096:4096" not in " ".join(docker.argv())


def test_sources_digest_follows_what_goes_into_the_image(tmp_path: Path) -> None:
    for relative in ("Containerfile", "src/coderunner/sandbox/requirements.txt", "containers/coderunner-kernel",
                     "src/coderunner/guest/dispatch.py"):  # fmt: skip
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("v1")
    first = sources_digest(tmp_path)
    (tmp_path / "src/coderunner/guest/dispatch.py").write_text("v2")
    assert sources_digest(tmp_path) != first


def test_backend_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.platform", "linux")
    assert default_backend() == "bwrap"
    monkeypatch.setattr("sys.platform", "darwin")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/local/bin/container" if name == "container" else None)
    assert default_backend() == "apple"
    monkeypatch.setattr("shutil.which", lambda name: "/usr/local/bin/docker" if name == "docker" else None)
    assert default_backend() == "docker"
    settings = Settings(backend="podman", oci_runtime="runc", _env_file=None)  # type: ignore[call-arg]
    assert settings.backend == "podman" and settings.image.startswith("coderunner-sandbox:")
    assert settings.kernel_channels == "auto"


def test_seccomp_profile_file_is_written_once_per_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from coderunner.sandbox import oci

    source = tmp_path / "engine.json"
    source.write_text(json.dumps({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read", "ptrace"],
                                  "action": "SCMP_ACT_ALLOW"}]}))  # fmt: skip
    monkeypatch.setattr(oci, "ENGINE_SECCOMP_PROFILES", (tmp_path / "missing.json", source))
    first = oci.write_seccomp_profile(tmp_path)
    assert first is not None and first == oci.write_seccomp_profile(tmp_path)
    assert json.loads(first.read_text())["syscalls"][0]["names"] == ["read"]
    assert first.stat().st_mode & 0o777 == 0o644
    monkeypatch.setattr(oci, "ENGINE_SECCOMP_PROFILES", (tmp_path / "missing.json",))
    assert oci.write_seccomp_profile(tmp_path) is None


def test_doctor_says_which_backend_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from coderunner import doctor

    monkeypatch.setattr("sys.platform", "linux")
    chosen = doctor.check_backend_choice(Settings(backend="podman"))
    assert chosen.detail.startswith("podman: chosen by the configuration")
    assert "the Linux default" in doctor.check_backend_choice(Settings()).detail
    assert doctor._engine_problem(Settings(), "apple") == ("macOS 26 on Apple silicon only", None)
    monkeypatch.setattr("shutil.which", lambda name: None)
    missing, fix = doctor._engine_problem(Settings(), "podman")
    assert missing == "`podman` is not installed" and fix and "apt-get install podman" in fix


def test_watch_plan_argv_and_round_trip() -> None:
    from coderunner.sandbox.watcher import WatchPlan

    plan = WatchPlan(["podman", "--runtime", "runc"], "podman", "coderunner.instance=0123")
    assert WatchPlan.from_json(plan.to_json()) == plan
    assert plan.list_argv() == [
        "podman", "--runtime", "runc", "ps", "--all", "--quiet", "--filter", "label=coderunner.instance=0123",
    ]  # fmt: skip
    assert plan.remove_argv(["a1", "b2"]) == ["podman", "--runtime", "runc", "rm", "--force", "--time", "0", "a1", "b2"]
    assert WatchPlan(["docker"], "docker", "l=v").remove_argv(["a1"]) == ["docker", "rm", "--force", "a1"]
    runsc = WatchPlan(["runsc", "--root=/r/root"], "runsc", "/r/root", clear_dir="/r")
    assert WatchPlan.from_json(runsc.to_json()) == runsc
    assert runsc.list_argv() == ["runsc", "--root=/r/root", "list", "-quiet"]
    assert runsc.remove_argv(["c1", "c2"]) == ["runsc", "--root=/r/root", "delete", "--force", "c1", "c2"]


def test_the_watcher_sweeps_when_its_server_lets_go_and_not_before(tmp_path: Path) -> None:
    """A fake engine records what the watcher asks of it (the real one: tests/abuse/test_abuse_podman.py)."""
    import time

    from coderunner.sandbox.watcher import Watcher, WatchPlan

    calls = tmp_path / "calls"
    engine = tmp_path / "engine"
    # Lists two containers until they are removed, then none.
    engine.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\nif [ "$1" = ps ] && ! grep -q "^rm" {calls}; then echo c1; echo c2; fi\n'
    )
    engine.chmod(0o755)
    watcher = Watcher(WatchPlan([str(engine)], "podman", "coderunner.instance=x"), {"PATH": "/usr/bin:/bin"})
    watcher.ensure_running()
    first = watcher.pid
    watcher.ensure_running()
    assert watcher.pid == first, "a running watcher is kept"
    time.sleep(0.5)
    assert not calls.exists(), "nothing is removed while the server holds the pipe"
    assert watcher._write_fd is not None
    os.close(watcher._write_fd)  # what the server's death does
    watcher._write_fd = None
    assert watcher._process is not None
    watcher._process.wait(timeout=60)
    listing = "ps --all --quiet --filter label=coderunner.instance=x"
    assert calls.read_text().splitlines() == [listing, "rm --force --time 0 c1 c2", listing], "sweeps until none"


def test_gvisor_runs_runsc_directly_with_its_flags_under_its_own_root() -> None:
    from coderunner.sandbox.runsc import RUNTIME_FLAGS, Runsc

    runsc = Runsc("/usr/bin/runsc", Path("/var/lib/cr/.runsc/abc/root"))
    base = ["/usr/bin/runsc", "--root=/var/lib/cr/.runsc/abc/root", *(f"--{flag}" for flag in RUNTIME_FLAGS)]
    assert runsc.base() == base
    assert {"--network=none", "--host-uds=create", "--platform=ptrace", "--overlay2=none"} <= set(base)
    assert runsc.run(Path("/b"), "c1") == [*base, "run", "--bundle=/b", "c1"]
    assert runsc.restore(Path("/i"), Path("/b"), "c1") == [*base, "restore", "--image-path=/i", "--bundle=/b", "c1"]
    assert runsc.checkpoint(Path("/i"), "c1") == [*base, "checkpoint", "--image-path=/i", "c1"]  # no --leave-running
    assert runsc.kill("c1", "USR1") == [*base, "kill", "c1", "USR1"]
    assert runsc.delete("c1", "c2") == [*base, "delete", "--force", "c1", "c2"]


def test_gvisor_argv_names_the_fixed_inside_paths_and_a_kernel_runs_behind_the_relay() -> None:
    from coderunner.sandbox.common import CHANNEL_RELAY, HOST_INSIDE, IMAGE_PYTHON, RUN_INSIDE
    from coderunner.sandbox.runsc import inner_argv, translate

    made = spec()
    argv = ["python", "-f", "/tmp/cr/9f8e7d6c/host/kernel-0.json", "/tmp/cr/9f8e7d6c/run", "/tmp/cr/9f8e7d6c/hostile",
            "x/tmp/cr/9f8e7d6c/host/a", "/tmp/cr/9f8e7d6c/run/k0"]  # fmt: skip
    assert translate(argv, made) == [
        "python", "-f", f"{HOST_INSIDE}/kernel-0.json", RUN_INSIDE, "/tmp/cr/9f8e7d6c/hostile",
        "x/tmp/cr/9f8e7d6c/host/a", f"{RUN_INSIDE}/k0",
    ]  # fmt: skip
    kernel = inner_argv(made, ["python", "-m", "k", "-f", "/tmp/cr/9f8e7d6c/host/kernel-0.json"], pipes=False)
    prefix = ["/usr/bin/prlimit", f"--as={2048 * 2**20}:unlimited", "--nproc=256", "--"]
    assert kernel == [IMAGE_PYTHON, "-I", "-S", CHANNEL_RELAY, "--run-dir", RUN_INSIDE, "--",
                      *prefix, "python", "-m", "k", "-f", f"{HOST_INSIDE}/kernel-0.json"]  # fmt: skip
    assert inner_argv(made, ["python", "x.py"], pipes=True) == [*prefix, "python", "x.py"]  # one-shot: no relay


def test_gvisor_config_holds_what_podman_flags_gave() -> None:
    from coderunner.sandbox.common import HOST_INSIDE, RUN_INSIDE
    from coderunner.sandbox.runsc import ConfigInputs, host_pids, mount_points, oci_config
    from coderunner.vocabulary.host_identity import HostIdentity
    from coderunner.vocabulary.sandbox_layout import SANDBOX_UID

    inputs = ConfigInputs(Path("/b/rootfs"), SANDBOX_UID, SANDBOX_UID, "coderunner-t-9f8e7d6c-abc", 4096, 4096)
    made = spec(user=HostIdentity("u", 70001, 70001))
    config = oci_config(made, ["python"], inputs, pipes=False)
    process = config["process"]
    assert process["user"]["uid"] == 70001 and process["user"]["gid"] == 70001  # the spec's own identity
    assert oci_config(spec(), ["p"], inputs, pipes=False)["process"]["user"]["uid"] == SANDBOX_UID
    assert process["noNewPrivileges"] is True and process["terminal"] is False
    assert all(value == [] for value in process["capabilities"].values()) and len(process["capabilities"]) == 5
    assert process["cwd"] == "/workspace"
    env = dict(item.split("=", 1) for item in process["env"])
    # exactly the podman backend's environment, nothing of the host's
    assert process["env"] == ENV_FLAGS[1::2] and env["HOME"] == "/tmp/home"
    assert {"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096} in process["rlimits"]
    assert config["root"] == {"path": "/b/rootfs", "readonly": True}
    assert config["hostname"] == "sandbox"
    mounts = {mount["destination"]: mount for mount in config["mounts"]}
    assert mounts["/tmp"]["type"] == "tmpfs" and "size=512m" in mounts["/tmp"]["options"]
    assert "mode=1777" in mounts["/tmp"]["options"]
    assert mounts["/sys"]["type"] == "tmpfs" and "ro" in mounts["/sys"]["options"]
    assert "size=64m" in mounts["/dev/shm"]["options"] and mounts["/proc"]["type"] == "proc"
    for destination, source, mode in (
        ("/workspace", "/srv/w/9f8e7d6c", "rw"), (RUN_INSIDE, "/tmp/cr/9f8e7d6c/run", "rw"),
        (HOST_INSIDE, "/tmp/cr/9f8e7d6c/host", "ro"), ("/data", "/home/ann/data", "ro"),
        ("/out", "/home/ann/out", "rw"),
        ("/etc/hosts", "/tmp/cr/9f8e7d6c/host/etc/hosts", "ro"),
        ("/etc/resolv.conf", "/tmp/cr/9f8e7d6c/host/etc/resolv.conf", "ro"),
    ):  # fmt: skip
        assert mounts[destination]["source"] == source and mode in mounts[destination]["options"], destination
    assert "/opt/coderunner/lib/coderunner_guest" not in mounts  # only with the development knob
    linux = config["linux"]
    assert linux["cgroupsPath"] == "/coderunner-t-9f8e7d6c-abc"  # named after the container
    assert linux["resources"] == {
        "memory": {"limit": 2048 * 2**20, "swap": 2048 * 2**20},
        "cpu": {"quota": 150_000, "period": 100_000},
        "pids": {"limit": host_pids(256)},
    }
    assert {"type": "network"} in linux["namespaces"]
    assert host_pids(256) > 5 * 256  # measured: ~5 host tasks per guest process under ptrace
    assert mount_points(made) == ["/workspace", RUN_INSIDE, HOST_INSIDE, "/data", "/out"]
    assert mount_points(spec(mounts=(Mount(Path("/x"), "/a/../../b/", True),)))[-1] == "/b"
    for bad in ("relative", "/", "/a/.."):
        with pytest.raises(ValueError):
            mount_points(spec(mounts=(Mount(Path("/x"), bad, True),)))
    dev = ConfigInputs(Path("/b/rootfs"), 1, 1, "c", 1, 1, dev_guest_lib=Path("/src/guest"))
    guest = {m["destination"]: m for m in oci_config(spec(), ["p"], dev, pipes=False)["mounts"]}
    assert guest["/opt/coderunner/lib/coderunner_guest"]["source"] == "/src/guest"
    assert "ro" in guest["/opt/coderunner/lib/coderunner_guest"]["options"]


def test_gvisor_relay_state_parsing_and_container_sessions() -> None:
    from coderunner.sandbox.gvisor import session_of
    from coderunner.sandbox.runsc import parse_relay_state, short_reason

    assert parse_relay_state(b"closed 3\n") == ("closed", 3)
    assert parse_relay_state(b"open 12") == ("open", 12)
    for bad in (b"", b"open", b"shut 1", b"open -1", b"open x", b"\xff 1", b"open 1 2"):
        assert parse_relay_state(bad) is None, bad
    name = container_name("1b802d50", "cc33dd44")
    assert session_of(name, "1b802d50") == "cc33dd44" and session_of(name, "other") is None
    assert "Cannot save endpoint" in short_reason("W1123 stack\npanic: Cannot save endpoint with bound host socket\n")
