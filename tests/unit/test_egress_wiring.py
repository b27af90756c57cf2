"""Network 'allowlist' as pure functions: settings, the option policy, and the sandbox argv.

No server and no sandbox here; the real thing runs in test_e2e_egress.py and abuse/test_abuse_egress.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from coderunner.config import ConfigError, Settings, load_settings
from coderunner.errors import SessionError
from coderunner.sandbox.apple import AppleBackend
from coderunner.sandbox.base import Limits, SandboxSpec
from coderunner.sandbox.bwrap import BwrapCommand
from coderunner.sandbox.common import EGRESS_FORWARDER, EGRESS_PORT, EGRESS_SOCKET, egress_environment
from coderunner.sandbox.oci import OciCommand
from coderunner.sessions.sandbox_options import sandbox_options
from coderunner.vocabulary.sandbox_request import SandboxRequest

PROXY = f"http://127.0.0.1:{EGRESS_PORT}"


@dataclass
class AnyNetwork:
    identity: None = None

    def network_problem(self, network: str) -> str | None:
        return None


def settings(tmp_path: Path, **overrides: object) -> Settings:
    base = {"runtime_dir": tmp_path / "r", "workspaces_dir": tmp_path / "w", "sandbox_env": tmp_path / "env",
            "token_file": tmp_path / "token", "export_dir": ""}  # fmt: skip
    return load_settings(Path(os.devnull), **{**base, **overrides})


# --- settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ['["python-packages", "*.example.com"]', "python-packages, *.example.com"])
def test_allowed_domains_from_the_environment_as_json_or_commas(tmp_path: Path, monkeypatch, text: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CODERUNNER_ALLOWED_DOMAINS", text)
    monkeypatch.setenv("CODERUNNER_ALLOWED_PORTS", "443,8443")
    loaded = settings(tmp_path)
    assert loaded.allowed_domains == ["python-packages", "*.example.com"]
    assert loaded.allowed_ports == [443, 8443]


def test_bad_allowed_domains_and_ports_are_told_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="allowed_domains"):
        settings(tmp_path, allowed_domains=["*"])
    with pytest.raises(ConfigError, match="allowed_ports"):
        settings(tmp_path, allowed_ports=[0])


def test_allowlist_as_the_default_needs_a_ceiling(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="allowed_domains"):
        settings(tmp_path, network="allowlist")
    assert settings(tmp_path, network="allowlist", allowed_domains=["github"]).network == "allowlist"


def test_serve_flags_set_the_network_and_the_ceiling() -> None:
    from coderunner.cli import _parser, _settings

    args = _parser().parse_args(
        ["serve", "--network", "allowlist", "--allow-domain", "python-packages", "--allow-domain", "github"]
    )
    loaded = _settings(args)
    assert loaded.network == "allowlist" and loaded.allowed_domains == ["python-packages", "github"]


# --- the option policy ---------------------------------------------------------------------------------


def test_allowlist_without_a_ceiling_says_how_to_set_one(tmp_path: Path) -> None:
    with pytest.raises(SessionError) as refused:
        sandbox_options(settings(tmp_path), AnyNetwork(), [], SandboxRequest(network="allowlist"))  # type: ignore[arg-type]
    message = str(refused.value)
    assert "allowed_domains" in message and "CODERUNNER_ALLOWED_DOMAINS" in message and "--allow-domain" in message


def test_a_session_asks_for_a_subset_never_more(tmp_path: Path) -> None:
    config = settings(tmp_path, allowed_domains=["python-packages", "*.example.com"])
    backend = AnyNetwork()
    asked = sandbox_options(config, backend, [], SandboxRequest(network="allowlist", allow=("api.example.com",)))  # type: ignore[arg-type]
    assert asked.network == "allowlist" and asked.allow == ("api.example.com",)
    whole = sandbox_options(config, backend, [], SandboxRequest(network="allowlist"))  # type: ignore[arg-type]
    assert whole.allow == ()
    with pytest.raises(SessionError, match="allowed_domains"):
        sandbox_options(config, backend, [], SandboxRequest(network="allowlist", allow=("evil.test",)))  # type: ignore[arg-type]
    with pytest.raises(SessionError, match="allowlist"):
        sandbox_options(config, backend, [], SandboxRequest(network="internet", allow=("api.example.com",)))  # type: ignore[arg-type]


# --- what the sandbox is given -------------------------------------------------------------------------


def spec(tmp_path: Path, network: str) -> SandboxSpec:
    return SandboxSpec(name="abcd1234", workspace=tmp_path / "ws", runtime_dir=tmp_path / "run",
                       host_dir=tmp_path / "host", limits=Limits(), network=network)  # fmt: skip


def test_bwrap_allowlist_is_loopback_only_with_the_forwarder_first(tmp_path: Path) -> None:
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=Path("/opt/env"))
    argv = command.argv(spec(tmp_path, "allowlist"), ["python", "-m", "ipykernel_launcher"], gate_fd=9)
    assert "--share-net" not in argv
    env = {argv[i + 1]: argv[i + 2] for i, arg in enumerate(argv) if arg == "--setenv"}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        assert env[name] == PROXY
    assert env["NO_PROXY"] == "localhost,127.0.0.1,::1" and "--require" in env["NODE_OPTIONS"]
    inner = argv[argv.index("--") + 1 :]
    start = inner.index(EGRESS_FORWARDER)
    assert inner[start + 1 : start + 4] == [str(tmp_path / "host" / EGRESS_SOCKET), str(EGRESS_PORT), "--"]
    assert inner[start + 4 :] == ["python", "-m", "ipykernel_launcher"]
    # The socket's dir is the host-only one, bound read-only.
    read_only = [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == "--ro-bind"]
    assert (str(tmp_path / "host"), str(tmp_path / "host")) in read_only


def test_other_modes_get_no_proxy_and_no_forwarder(tmp_path: Path) -> None:
    command = BwrapCommand(bwrap="/usr/bin/bwrap", env_dir=Path("/opt/env"))
    for network in ("none", "internet"):
        argv = command.argv(spec(tmp_path, network), ["python"], gate_fd=9)
        assert EGRESS_FORWARDER not in argv and "HTTP_PROXY" not in argv
        assert egress_environment(network) == {}


def test_podman_allowlist_has_no_network_and_the_forwarder(tmp_path: Path) -> None:
    command = OciCommand(engine="podman", kind="podman", image="img", server="s")
    argv = command.run(spec(tmp_path, "allowlist"), ["python"], "name", etc_dir=tmp_path / "etc")
    assert argv[argv.index("--network") + 1] == "none"
    assert f"HTTPS_PROXY={PROXY}" in argv and "--http-proxy=false" in argv
    assert argv[argv.index("img") + 1 :][:4] == ["/opt/coderunner/env/bin/python", "-I", "-S", EGRESS_FORWARDER]


def test_apple_refuses_allowlist_rather_than_pretend() -> None:
    backend = AppleBackend.__new__(AppleBackend)
    backend.channels = "ipc"
    problem = backend.network_problem("allowlist")
    assert problem is not None and "allowlist" in problem and "'none'" in problem
