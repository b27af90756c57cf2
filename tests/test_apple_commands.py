"""The Apple `container` backend's argv per version, and its parsing of each version's JSON.

Pure: nothing runs. The flags and shapes follow apple/container's sources (see
coderunner/sandbox/apple.py); tests/test_e2e_apple.py runs the backend for real on the stand-in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from coderunner.sandbox.apple import (
    GUEST_RUNTIME,
    GUEST_SOCKETS,
    GUEST_STATE,
    INIT_VERSION,
    MIN_VERSION,
    PINNED_VERSION,
    SECRET_VERSION,
    UPGRADE_HINT,
    AppleBackend,
    AppleCommand,
    ContainerVersion,
    GuestReady,
    container_id,
    instance_mark,
    names_with_prefix,
    parse_records,
    version_caveat,
    version_problem,
    vm_name,
)
from coderunner.sandbox.base import Limits, SandboxSpec
from coderunner.sandbox.container import ContainerUnavailable, name_prefix
from coderunner.sandbox.image_build import BuildCommand, build_command
from coderunner.sandbox.watcher import WatchPlan, apple_names
from coderunner.vocabulary.mounts import Mount

from .test_container_commands import ENV_FLAGS  # the same sandbox environment on every engine

FIXTURES = Path(__file__).parent / "fixtures" / "apple"
V0_9 = ContainerVersion(0, 9, 0)
V1_2 = ContainerVersion(1, 2, 2)
KERNEL = ["/opt/coderunner/env/bin/python", "-m", "ipykernel_launcher", "-f", "/tmp/cr/9f8e7d6c/run/kernel-0.json"]
NAME = "coderunner-1a2b3c4d-9f8e7d6c-a1b2c3"


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


# --- versions ------------------------------------------------------------------------------------------


def test_the_version_line_of_every_release_is_read() -> None:
    # ReleaseVersion.singleLine: "<app> version <v> (build: release, commit: <7 hex>)", 0.5.0 to 1.2.2.
    assert ContainerVersion.parse("container CLI version 0.6.0 (build: release, commit: 1a2b3c4)") == ContainerVersion(
        0, 6, 0
    )
    assert ContainerVersion.parse("container CLI version 1.2.2 (build: debug, commit: unspecified)") == V1_2
    assert ContainerVersion.parse("something else") is None
    assert str(V0_9) == "0.9.0" and V0_9 < INIT_VERSION <= V1_2


def test_too_old_or_unreadable_versions_are_refused_with_the_upgrade_command() -> None:
    assert (
        version_problem(ContainerVersion(0, 5, 0))
        == "Apple container 0.5.0 is older than 0.6.0, the oldest this server supports"
    )
    assert (
        "brew upgrade container" in UPGRADE_HINT
        and "./install.sh" in UPGRADE_HINT
        and str(PINNED_VERSION) in UPGRADE_HINT
    )
    assert "could not read the version" in (version_problem(None) or "")
    assert version_problem(MIN_VERSION) is None and version_problem(V1_2) is None
    assert "no `run --init`" in (version_caveat(V0_9) or "") and "no `build --secret`" in (version_caveat(V0_9) or "")
    assert "no `build --secret`" in (version_caveat(INIT_VERSION) or "") and version_caveat(SECRET_VERSION) is None


# --- run argv per version --------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "init"), [(V0_9, []), (INIT_VERSION, ["--init"]), (V1_2, ["--init"])])
def test_run_argv_relays_kernel_sockets_without_network(version: ContainerVersion, init: list[str]) -> None:
    command = AppleCommand(cli="/opt/homebrew/bin/container", image="coderunner-sandbox:0.1.0", version=version)
    sockets = [("/tmp/cr/9f8e7d6c/run/k0-5001", f"{GUEST_SOCKETS}-5001")]
    argv = command.run(spec(), KERNEL, NAME, sockets=sockets, state_dir=Path("/tmp/cr/9f8e7d6c/run/vm"))
    assert argv == [
        "/opt/homebrew/bin/container", "run", "--rm", *init, "--name", NAME,
        "--cpus", "2", "--memory", "2048M",
        "--network", "none",
        "--publish-socket", "/tmp/cr/9f8e7d6c/run/k0-5001:/run/coderunner/k-5001",
        "--volume", f"/tmp/cr/9f8e7d6c/host:{GUEST_RUNTIME}:ro",
        "--volume", "/srv/w/9f8e7d6c:/workspace",
        "--volume", f"/tmp/cr/9f8e7d6c/run/vm:{GUEST_STATE}",
        "--volume", "/home/ann/data:/data:ro",
        "--volume", "/home/ann/out:/out",
        "--workdir", "/workspace",
        *ENV_FLAGS,
        "coderunner-sandbox:0.1.0", *KERNEL,
    ]  # fmt: skip


def test_internet_and_the_tcp_fallback_join_the_default_network_by_leaving_network_out() -> None:
    command = AppleCommand(cli="container", image="img", version=V0_9)
    argv = command.run(spec(limits=Limits()), ["true"], "n", tcp_ports=[5001])
    assert "--network" not in argv  # every version then attaches its builtin network (Utility.swift)
    assert argv[argv.index("--publish") + 1] == "127.0.0.1:5001:5001"
    assert "--cpus" not in argv and "--memory" not in argv
    assert "--network" not in command.run(spec(network="internet"), ["true"], "n")


def test_lifecycle_argv() -> None:
    command = AppleCommand(cli="container", image="img:1")
    assert command.stop("n") == ["container", "stop", "--time", "2", "n"]
    assert command.delete("n") == ["container", "delete", "--force", "n"]
    assert command.inspect("n") == ["container", "inspect", "n"]
    assert command.list_all() == ["container", "list", "--all", "--format", "json"]
    assert command.system_status() == ["container", "system", "status"]
    assert command.image_inspect() == ["container", "image", "inspect", "img:1"]
    assert command.version_query() == ["container", "--version"]


def _backend(tmp_path: Path, channels: str = "ipc", version: ContainerVersion = V1_2) -> AppleBackend:
    """A backend object without a `container` CLI (its constructor would ask the CLI)."""
    backend = AppleBackend.__new__(AppleBackend)
    backend.channels = channels
    backend.version = version
    backend.command = AppleCommand(cli="container", image="img", version=version)
    backend.tag = "1a2b3c4d"
    backend.runtime_base = tmp_path
    return backend


def _connection(tmp_path: Path, transport: str) -> list[str]:
    run_dir = tmp_path / "9f8e7d6c" / "run"
    run_dir.mkdir(parents=True)
    ip = str(run_dir / "k0") if transport == "ipc" else "127.0.0.1"
    info = {"transport": transport, "ip": ip, "shell_port": 1, "iopub_port": 2, "stdin_port": 3,
            "control_port": 4, "hb_port": 5, "key": "k"}  # fmt: skip
    (run_dir / "kernel-0.json").write_text(json.dumps(info))
    return ["/opt/coderunner/env/bin/python", "-m", "ipykernel_launcher", "-f", str(run_dir / "kernel-0.json")]


def test_plan_relays_each_channel_and_runs_the_kernel_under_the_guest_init(tmp_path: Path) -> None:
    argv = _connection(tmp_path, "ipc")
    run_dir = tmp_path / "9f8e7d6c" / "run"
    planned = _backend(tmp_path, version=V0_9).plan(spec(runtime_dir=run_dir, mounts=()), argv, NAME)
    assert "--init" not in planned
    relays = [planned[i + 1] for i, flag in enumerate(planned) if flag == "--publish-socket"]
    assert relays == [f"{run_dir}/k0-{port}:{GUEST_SOCKETS}-{port}" for port in (1, 2, 3, 4, 5)]
    assert planned[planned.index("--network") + 1] == "none"
    inner = planned[planned.index("img") + 1 :]
    guests = [f"{GUEST_SOCKETS}-{port}" for port in (1, 2, 3, 4, 5)]
    assert inner[: inner.index("--")] == [
        "/opt/coderunner/env/bin/python", "-P", "-m", "coderunner_guest.vm_init",
        "--ready", f"{GUEST_STATE}/{NAME}.ready",
        *(flag for path in guests for flag in ("--socket", path)),
    ]  # fmt: skip
    kernel = inner[inner.index("--") + 1 :]
    assert kernel[:3] == ["/usr/bin/prlimit", f"--as={2048 * 2**20}:unlimited", "--nproc=256"]
    assert kernel[-1] == f"{GUEST_RUNTIME}/kernel-0.guest.json"
    assert json.loads((run_dir / "kernel-0.guest.json").read_text())["ip"] == GUEST_SOCKETS


def test_plan_tcp_fallback_binds_the_vm_address_not_every_address(tmp_path: Path) -> None:
    argv = _connection(tmp_path, "tcp")
    run_dir = tmp_path / "9f8e7d6c" / "run"
    backend = _backend(tmp_path, channels="tcp")
    assert "needs the container network" in (backend.network_problem("none") or "")
    planned = backend.plan(spec(runtime_dir=run_dir, network="internet", mounts=()), argv, NAME)
    assert "--init" in planned and planned[planned.index("--publish") + 1] == "127.0.0.1:1:1"
    inner = planned[planned.index("img") + 1 :]
    assert inner[inner.index("--") - 1] == "--tcp-own-address"  # vm_init swaps in the VM's own address
    assert "reachable at the VM's address" in backend.describe_isolation()


# --- the readiness marker ----------------------------------------------------------------------------------


class _Alive:
    alive = True


def test_the_marker_counts_only_as_a_regular_file(tmp_path: Path) -> None:
    with GuestReady(tmp_path, f"{NAME}.ready") as ready:
        assert ready.path == tmp_path / "vm" and not ready.marked()
        os.symlink("/etc/passwd", ready.path / f"{NAME}.ready")
        assert not ready.marked()  # a link is never followed
        os.unlink(ready.path / f"{NAME}.ready")
        (ready.path / f"{NAME}.ready").write_text("")
        assert ready.marked()
    assert not (tmp_path / "vm" / f"{NAME}.ready").exists()  # gone with the spawn that waited for it


def test_a_marker_that_never_comes_is_a_bounded_wait(tmp_path: Path) -> None:
    async def wait() -> None:
        with GuestReady(tmp_path, "x.ready") as ready:
            await ready.wait(_Alive(), 0.2)  # type: ignore[arg-type]

    with pytest.raises(ContainerUnavailable, match=r"did not bind its sockets within 0\.2s"):
        anyio.run(wait)


# --- inspect and list output of each version ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "name"),
    [
        ("inspect-0.7.json", "coderunner-1a2b3c4d-9f8e7d6c-a1b2c3"),
        ("inspect-0.10.json", "coderunner-1a2b3c4d-9f8e7d6c-d4e5f6"),
        ("inspect-1.0.json", "coderunner-1a2b3c4d-9f8e7d6c-0f9e8d"),
    ],
)
def test_inspect_id_of_every_version_shape(fixture: str, name: str) -> None:
    [record] = parse_records((FIXTURES / fixture).read_text())
    assert container_id(record) == name


def test_the_fixtures_have_each_version_s_real_shape() -> None:
    """0.x: PrintableContainer (status string, attachments beside the configuration, whose
    `networks` are AttachmentConfiguration objects); 1.x: ManagedContainer (top-level id, status object)."""
    [old] = parse_records((FIXTURES / "inspect-0.7.json").read_text())
    assert old["status"] == "running" and old["networks"][0]["address"] == "192.168.64.3/24"
    assert old["configuration"]["networks"] == [
        {"network": "default", "options": {"hostname": "coderunner-1a2b3c4d-9f8e7d6c-a1b2c3"}}
    ]
    [new] = parse_records((FIXTURES / "inspect-1.0.json").read_text())
    assert new["id"] == new["configuration"]["id"] and new["status"]["state"] == "running"


def test_inspect_edge_cases() -> None:
    assert parse_records('{"configuration": {"id": "x"}}') == [{"configuration": {"id": "x"}}]
    assert parse_records("") == [] and parse_records("[]") == []
    assert container_id({"id": "only-top"}) == "only-top" and container_id({"configuration": []}) is None


def test_list_is_filtered_by_name_prefix_across_shapes() -> None:
    output = (FIXTURES / "list-mixed.json").read_text()
    assert names_with_prefix(output, name_prefix("1a2b3c4d")) == [
        "coderunner-1a2b3c4d-9f8e7d6c-a1b2c3",
        "coderunner-1a2b3c4d-0badc0de-112233",
        "coderunner-1a2b3c4d-ca11ab1e-778899",
    ]
    assert names_with_prefix(output, name_prefix("1a2b3c4d", "0badc0de")) == ["coderunner-1a2b3c4d-0badc0de-112233"]


def test_sweep_deletes_only_vms_whose_session_dir_is_gone(tmp_path: Path) -> None:
    backend = _backend(tmp_path)
    (tmp_path / "9f8e7d6c").mkdir()
    output = (FIXTURES / "list-mixed.json").read_text()
    deleted: list[str] = []
    backend._query = lambda argv: output  # type: ignore[method-assign]
    backend._delete = deleted.append  # type: ignore[method-assign]
    backend.sweep()
    assert deleted == ["coderunner-1a2b3c4d-0badc0de-112233", "coderunner-1a2b3c4d-ca11ab1e-778899"]
    deleted.clear()
    backend.remove_stale("9f8e7d6c")
    assert deleted == ["coderunner-1a2b3c4d-9f8e7d6c-a1b2c3"]


# --- the image build (`coderunner setup --backend apple`) ---------------------------------------------

ROOTS = Path("/etc/ssl/certs/ca-certificates.crt")


def _build(version: ContainerVersion | None, ca_bundle: Path | None = ROOTS) -> BuildCommand:
    return BuildCommand(kind="apple", engine="container", image="img:1", context=Path("/src/cr"), digest="d",
                        ca_bundle=ca_bundle, apple_version=version)  # fmt: skip


@pytest.mark.parametrize(
    ("version", "secret"),
    [(V0_9, False), (ContainerVersion(0, 10, 0), False), (SECRET_VERSION, True), (V1_2, True), (None, False)],
)
def test_build_hands_pip_the_tls_roots_where_the_release_takes_them(
    version: ContainerVersion | None, secret: bool
) -> None:
    """`build --secret` exists from 0.11.0 (BuildCommand.swift); older releases refuse the option."""
    base = ["container", "build", "--tag", "img:1", "--file", "/src/cr/Containerfile",
            "--label", "coderunner.sources=d"]  # fmt: skip
    roots = ["--secret", f"id=ca_bundle,src={ROOTS}"] if secret else []
    assert _build(version).argv() == [*base, *roots, "/src/cr"]
    assert "--secret" not in _build(version, ca_bundle=None).argv()


def test_a_failed_build_says_what_to_do_about_an_intercepted_tls(tmp_path: Path) -> None:
    assert "upgrade with ./install.sh" in _build(V0_9).tls_hint() and "0.11.0" in _build(V0_9).tls_hint()
    hint = _build(V1_2).tls_hint()
    assert f"the build got {ROOTS}" in hint and "security find-certificate" in hint and "SSL_CERT_FILE=" in hint


def test_setup_reads_the_release_and_finds_the_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = tmp_path / "bin" / "container"
    cli.parent.mkdir()
    cli.write_text('#!/bin/sh\necho "container CLI version 0.11.0 (build: release, commit: 1a2b3c4)"\n')
    cli.chmod(0o755)
    roots = tmp_path / "roots.pem"
    roots.write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "Containerfile").write_text("FROM scratch\n")
    for relative in ("src/coderunner/sandbox/requirements.txt", "containers/coderunner-kernel"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("x")
    monkeypatch.setenv("PATH", f"{cli.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("SSL_CERT_FILE", str(roots))
    settings = SimpleNamespace(backend="apple", image="img:1", base_image=None, oci_runtime=None)
    command = build_command(settings, tmp_path)  # type: ignore[arg-type]
    assert command.apple_version == SECRET_VERSION and command.ca_bundle == roots
    assert command.argv()[-3:] == ["--secret", f"id=ca_bundle,src={roots}", str(tmp_path)]


def test_the_watcher_removes_only_its_own_server_process_s_vms() -> None:
    """Two servers of one configuration (same runtime dir, same tag): the end of one removes its own
    VMs, never the other's live ones."""
    tag, mine, theirs = "1a2b3c4d", "00c0ffee", "0beef000"
    names = [vm_name(tag, session, instance) for session, instance in
             [("9f8e7d6c", mine), ("0badc0de", theirs), ("ca11ab1e", mine)]]  # fmt: skip
    output = json.dumps([{"configuration": {"id": name}, "id": name} for name in [*names, "postgres"]])
    plan = WatchPlan(["container"], "apple", instance_mark(mine))
    assert plan.list_argv() == ["container", "list", "--all", "--format", "json"]
    assert plan.remove_argv(["a", "b"]) == ["container", "delete", "--force", "a", "b"]
    assert apple_names(output, plan.label) == [names[0], names[2]]
    assert apple_names(output, instance_mark(theirs)) == [names[1]]
    # The configuration's prefix (the start's sweep, remove_stale) still finds them all, by session too.
    assert names_with_prefix(output, name_prefix(tag)) == names
    assert names_with_prefix(output, name_prefix(tag, "0badc0de")) == [names[1]]
    assert apple_names("not json", plan.label) == []
