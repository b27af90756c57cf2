"""What `coderunner doctor` and the backend's start say about Apple `container`, per release.

They ask the real CLI, so these run the stand-in (tests/emulators/container) at the release each
case needs; nothing starts a VM here. doctor's Apple checks run on macOS only, so the platform is
set to darwin for them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coderunner import doctor
from coderunner.config import Settings
from coderunner.sandbox import apple_doctor
from coderunner.sandbox.apple import AppleBackend
from coderunner.sandbox.container import ContainerUnavailable

from . import apple_emulation


@pytest.fixture
def on_a_mac(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A function that puts the stand-in at a release first on PATH, as if this were macOS."""
    if problem := apple_emulation.emulation_problem():
        pytest.fail(problem)
    monkeypatch.setattr(sys, "platform", "darwin")

    def use(version: str, system: str = "running") -> Path:
        folder = apple_emulation.cli_dir(tmp_path / "bin", version)
        if system != "running":
            wrapper = folder / "container"
            wrapper.write_text(wrapper.read_text().replace("exec", f"CONTAINER_EMULATE_SYSTEM={system} exec"))
        monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
        return folder / "container"

    return use


def test_a_release_older_than_the_minimum_is_refused_with_the_upgrade_command(on_a_mac, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cli = on_a_mac("0.5.0")
    with pytest.raises(ContainerUnavailable) as refused:
        AppleBackend("coderunner-sandbox:0.1.0", tmp_path / "r", cli=str(cli))
    assert "Apple container 0.5.0 is older than 0.6.0" in str(refused.value)
    assert "brew upgrade container" in str(refused.value) and "./install.sh" in str(refused.value)
    missing, fix = doctor._engine_problem(Settings(backend="apple"), "apple")
    assert missing == "Apple container 0.5.0 is older than 0.6.0, the oldest this server supports"
    assert fix and "brew upgrade container" in fix


def test_doctor_reads_a_missing_image_in_0_6_s_words(on_a_mac) -> None:  # type: ignore[no-untyped-def]
    on_a_mac("0.6.0")  # says `notFound: "images: NAME"`, not "not found"
    settings = Settings(backend="apple", image="localhost/coderunner-no-such-image:0")
    assert doctor._engine_problem(settings, "apple") == (
        "image localhost/coderunner-no-such-image:0 not built",
        "coderunner setup --backend apple",
    )


def test_doctor_says_the_system_service_is_down(on_a_mac) -> None:  # type: ignore[no-untyped-def]
    on_a_mac("1.2.2", system="stopped")
    assert doctor._engine_problem(Settings(backend="apple"), "apple") == (
        "the container system service is not running",
        "container system start --enable-kernel-install",
    )


@pytest.mark.parametrize(
    ("version", "detail", "degraded"),
    [("1.2.2", "Apple container 1.2.2 (supported)", False), ("0.9.0", "0.9.0 predates 0.10.0", True)],
)
def test_doctor_reports_the_release_and_whether_it_is_supported(
    on_a_mac,  # type: ignore[no-untyped-def]
    version: str,
    detail: str,
    degraded: bool,
) -> None:
    cli = on_a_mac(version)
    image = apple_emulation.build_image(cli.parent)  # current already, unless the sources changed
    [backend, channels] = doctor.check_backend(Settings(backend="apple", image=image))
    assert backend.ok and detail in backend.detail and backend.degraded is degraded, backend
    assert channels.ok and not channels.degraded and "relayed over vsock" in channels.detail


def test_doctor_tells_the_tcp_fallback_truthfully() -> None:
    check = apple_doctor.channels_check(Settings(backend="apple", kernel_channels="tcp"))
    assert check.degraded and "reachable at the VM's address" in check.detail
    assert "other containers" in check.detail and "Local Network" in check.detail
