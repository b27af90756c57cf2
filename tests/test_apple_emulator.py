"""The `container` stand-in answers as apple/container's sources say each release does.

Only what needs no VM: parsing (argument-parser's refusals), names, `--publish-socket` checks,
the per-release answers for unknown names, and `build --secret` (a tiny image, built through
`coderunner setup`'s own code). The backend's own use of it is test_e2e_apple.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from coderunner.sandbox.apple import ContainerVersion, names_with_prefix
from coderunner.sandbox.image_build import ImageError, build

from . import apple_emulation
from .image_lock import image_build_lock

UNKNOWN = "coderunner-no-such-vm-0"


@pytest.fixture(autouse=True)
def _usable() -> None:
    if problem := apple_emulation.emulation_problem():
        pytest.fail(problem)


def container(version: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINER_EMULATE_VERSION": version}
    return subprocess.run([str(apple_emulation.EMULATOR), *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)  # fmt: skip


@pytest.mark.parametrize("version", ["0.6.0", "0.9.0", "1.2.2"])
def test_version_line(version: str) -> None:
    done = container(version, "--version")
    assert done.returncode == 0 and str(ContainerVersion.parse(done.stdout)) == version


@pytest.mark.parametrize(
    ("version", "flag"),
    [("0.9.0", "--init"), ("0.7.1", "--read-only"), ("0.6.0", "--rosetta"), ("0.12.3", "--shm-size")],
)
def test_options_newer_than_the_release_are_refused_as_argument_parser_does(version: str, flag: str) -> None:
    done = container(version, "run", "--rm", flag, "--name", "x1", "img", "true")
    assert done.returncode == 64, done
    assert done.stderr.startswith(f"Error: Unknown option '{flag}'\nUsage: container run [<options>] <image>")
    assert "See 'container run --help' for more details." in done.stderr


def test_what_follows_the_image_is_the_process_s_own() -> None:
    """`.captureForPassthrough`: options after the image are the command's, never the CLI's."""
    done = container("0.9.0", "run", "--name", "bad name", "img", "python", "--init")
    assert done.returncode == 1 and 'invalidArgument: "invalid entity name bad name"' in done.stderr


@pytest.mark.parametrize(
    ("version", "said"),
    [("1.1.0", "invalid entity name -x"), ("1.2.2", "container ID -x is not a valid container ID")],
)
def test_name_rules(version: str, said: str) -> None:
    done = container(version, "run", "--name=-x", "img", "true")
    assert done.returncode == 1 and said in done.stderr


def test_network_none_stands_alone() -> None:
    done = container("1.2.2", "run", "--network", "none", "--network", "default", "--name", "x1", "img", "true")
    assert done.returncode == 1 and "no other networks may be created along with network none" in done.stderr


def test_a_live_host_socket_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "k0-5001"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    try:
        done = container("1.2.2", "run", "--publish-socket", f"{path}:/run/k", "--name", "x1", "img", "true")
    finally:
        live.close()
    assert done.returncode == 1 and f"host socket {path} already exists and may be in use" in done.stderr
    odd = container("1.2.2", "run", "--publish-socket", "a:b:c", "--name", "x1", "img", "true")
    assert "invalid publish-socket format a:b:c. Expected: host_path:container_path" in odd.stderr


def test_unknown_names_per_release() -> None:
    """0.x `inspect` prints [] and `stop` is silent; 1.x both fail. `delete` fails in both."""
    assert (done := container("0.9.0", "inspect", UNKNOWN)).returncode == 0 and done.stdout.strip() == "[]"
    assert container("0.9.0", "stop", UNKNOWN).returncode == 0
    failed = container("1.2.2", "inspect", UNKNOWN)
    assert failed.returncode == 1 and f'Error: notFound: "container not found: {UNKNOWN}"' in failed.stderr
    assert container("1.2.2", "stop", UNKNOWN).returncode == 1
    for version in ("0.9.0", "1.2.2"):
        deleted = container(version, "delete", "--force", UNKNOWN)
        assert deleted.returncode == 1 and "notFound" in deleted.stderr
    for version in ("0.9.0", "1.2.2"):
        listed = container(version, "list", "--all", "--format", "json")
        assert listed.returncode == 0 and names_with_prefix(listed.stdout, UNKNOWN) == []


# --- `build --secret`: the TLS roots reach pip only if the release takes them and the CLI hands them on ----


def _secret_context(tmp_path: Path) -> Path:
    """A build context whose one RUN step needs the `ca_bundle` secret, as the Containerfile's pip does.

    The step's text is new each run, so no cached layer (podman's, from any earlier build) can
    stand in for a build that did not get the secret.
    """
    context = tmp_path / "context"
    for relative in ("src/coderunner/sandbox/requirements.txt", "containers/coderunner-kernel"):
        (context / relative).parent.mkdir(parents=True, exist_ok=True)
        (context / relative).write_text("x")
    (context / "Containerfile").write_text(
        "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\n"
        "RUN --mount=type=secret,id=ca_bundle,required=false "
        f"grep -q CODERUNNER-TEST-ROOT /run/secrets/ca_bundle && echo {uuid.uuid4().hex}\n"
    )
    return context


@pytest.mark.parametrize("version", ["0.9.0", "1.2.2"])
def test_setup_hands_the_tls_roots_to_a_release_that_takes_them(
    version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`coderunner setup --backend apple`'s build, through the stand-in and podman: at 1.2.2 the
    roots reach the RUN step; 0.9.0 has no `--secret`, so the build fails and says what to do."""
    try:
        with image_build_lock():
            base = apple_emulation.base_image()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    roots = tmp_path / "roots.pem"
    roots.write_text("-----BEGIN CERTIFICATE-----\nCODERUNNER-TEST-ROOT\n-----END CERTIFICATE-----\n")
    folder = apple_emulation.cli_dir(tmp_path / "bin", version)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    monkeypatch.setenv("SSL_CERT_FILE", str(roots))
    image = f"localhost/coderunner-apple-secret-test:{uuid.uuid4().hex[:12]}"
    settings = SimpleNamespace(backend="apple", image=image, base_image=base, oci_runtime=None)
    try:
        if version == "1.2.2":
            assert build(settings, repo=_secret_context(tmp_path)) == image  # type: ignore[arg-type]
        else:
            with pytest.raises(ImageError, match="cannot hand the build a TLS root"):
                build(settings, repo=_secret_context(tmp_path))  # type: ignore[arg-type]
    finally:
        subprocess.run(["podman", "rmi", "--force", image], capture_output=True, timeout=120, check=False)


def test_secret_options_are_read_as_the_cli_reads_them(tmp_path: Path) -> None:
    """BuildCommand.validate: `id=` first; `src=` a file the CLI reads before building."""
    refused = container("1.2.2", "build", "--secret", "src=/x", str(tmp_path))
    assert refused.returncode == 64 and "secret must start with id=<key>" in refused.stderr
    missing = container("1.2.2", "build", "--secret", f"id=ca_bundle,src={tmp_path / 'none.pem'}", str(tmp_path))
    assert missing.returncode == 1 and "No such file" in missing.stderr
    older = container("0.10.0", "build", "--secret", "id=ca_bundle,src=/x", str(tmp_path))
    assert older.returncode == 64 and "Unknown option '--secret'" in older.stderr
