"""The option and mount policy (options.py) as pure functions: no server, no sandbox."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from coderunner.config import MIN_MEMORY_MB, Settings, load_settings
from coderunner.errors import SessionError
from coderunner.sandbox import Mount, SandboxBackend
from coderunner.sessions.sandbox_options import (
    SandboxOptions,
    export_mount,
    protected_paths,
    sandbox_options,
    session_mounts,
)
from coderunner.vocabulary.mounts import MountSpec
from coderunner.vocabulary.sandbox_request import SandboxRequest


@dataclass
class FakeBackend:
    """Only what the policy asks of a backend: its sandbox identity and which networks it offers."""

    identity: None = None

    def network_problem(self, network: str) -> str | None:
        return None if network in ("none", "internet") else f"network {network!r} is not offered here"


def settings(tmp_path: Path, **overrides: object) -> Settings:
    base = {
        "runtime_dir": tmp_path / "run",
        "workspaces_dir": tmp_path / "workspaces",
        "sandbox_env": tmp_path / "env",
        "token_file": tmp_path / "token",
    }
    loaded = load_settings(Path(os.devnull), **{**base, **overrides})
    return loaded if "export_dir" in overrides else loaded.model_copy(update={"export_dir": None})


def options(
    tmp_path: Path, base_mounts: list[Mount] | None = None, config: Settings | None = None, **asked: object
) -> SandboxOptions:
    backend: SandboxBackend = FakeBackend()  # type: ignore[assignment]
    return sandbox_options(config or settings(tmp_path), backend, base_mounts or [], SandboxRequest(**asked))  # type: ignore[arg-type]


def test_defaults_come_from_the_settings(tmp_path: Path) -> None:
    config = settings(tmp_path, memory_mb=1024, timeout_s=12)
    made = options(tmp_path, config=config)
    assert (made.network, made.timeout_s, made.limits.memory_mb) == (config.network, 12, 1024)
    assert made.limits.pids == config.pids and made.limits.disk_mb == config.disk_mb
    assert made.mounts == () and not made.persistent and made.name is None


def test_what_was_asked_for_wins(tmp_path: Path) -> None:
    config = settings(tmp_path, max_network="internet")
    made = options(tmp_path, config=config, network="internet", memory_mb=2048, cpus=1.5, timeout_s=30, name="a.b-c_1")
    assert (made.network, made.limits.memory_mb, made.limits.cpus, made.timeout_s) == ("internet", 2048, 1.5, 30)
    assert made.name == "a.b-c_1"


@pytest.mark.parametrize(
    ("asked", "needle"),
    [
        ({"name": "-starts-with-dash"}, "use 1-40 letters"),
        ({"name": "x" * 41}, "use 1-40 letters"),
        ({"persistent": True}, "needs a name"),
        ({"network": "bridge"}, "not offered here"),
        ({"memory_mb": MIN_MEMORY_MB - 1}, f"at least {MIN_MEMORY_MB}"),
        ({"cpus": 0}, "cpus must be positive"),
        ({"timeout_s": 0}, "timeout_s must be between"),
        ({"timeout_s": 10**9}, "timeout_s must be between"),
    ],
)
def test_each_refusal_says_what_to_ask_for(tmp_path: Path, asked: dict[str, object], needle: str) -> None:
    with pytest.raises(SessionError, match=needle):
        options(tmp_path, **asked)


def test_session_mounts_only_under_an_allowed_root(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed" / "data", tmp_path / "outside"
    allowed.mkdir(parents=True)
    outside.mkdir()
    config = settings(tmp_path, allowed_mount_roots=[tmp_path / "allowed"])
    [mount] = session_mounts(config, None, [], [MountSpec(host=allowed, sandbox="/data")])
    assert (mount.host, mount.sandbox, mount.writable) == (allowed.resolve(), "/data", False)
    with pytest.raises(SessionError, match="sessions may mount only under"):
        session_mounts(config, None, [], [MountSpec(host=outside, sandbox="/data")])
    with pytest.raises(SessionError, match="none are configured"):
        session_mounts(settings(tmp_path), None, [], [MountSpec(host=allowed, sandbox="/data")])


def test_session_mounts_may_not_take_a_base_mounts_place(tmp_path: Path) -> None:
    data = tmp_path / "allowed" / "data"
    data.mkdir(parents=True)
    config = settings(tmp_path, allowed_mount_roots=[tmp_path / "allowed"])
    base = [Mount(tmp_path, "/data", writable=False)]
    with pytest.raises(SessionError, match="two mounts at /data"):
        session_mounts(config, None, base, [MountSpec(host=data, sandbox="/data")])


def test_the_servers_own_state_is_protected(tmp_path: Path) -> None:
    config = settings(tmp_path, allowed_mount_roots=[tmp_path])
    assert config.runtime_dir in protected_paths(config) and config.workspaces_dir in protected_paths(config)
    (tmp_path / "workspaces").mkdir()
    with pytest.raises(SessionError, match="overlaps CodeRunner's own state"):
        session_mounts(config, None, [], [MountSpec(host=tmp_path / "workspaces", sandbox="/data")])


def test_the_export_mount_is_reserved_only_when_exports_are_on(tmp_path: Path) -> None:
    assert export_mount(settings(tmp_path)) == []
    [reserved] = export_mount(settings(tmp_path, export_dir=tmp_path / "exports"))
    assert reserved.writable and reserved.sandbox.startswith("/")
