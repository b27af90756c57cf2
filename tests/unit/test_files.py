"""The host's view of sandbox files, and the mount rules, without a sandbox."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coderunner.hostfs.mounts import resolve_mount
from coderunner.hostfs.sandbox_files import FileAccessError, SandboxFiles
from coderunner.policy.mounts import MountError, check_sandbox_path
from coderunner.vocabulary.mounts import Mount, MountSpec


@pytest.fixture
def view(tmp_path: Path) -> SandboxFiles:
    workspace = tmp_path / "ws"
    data = tmp_path / "data"
    workspace.mkdir()
    data.mkdir()
    (data / "table.csv").write_text("a,b\n")
    (tmp_path / "host-secret").write_text("secret")
    return SandboxFiles([Mount(workspace, "/workspace", True), Mount(data, "/data", False)])


def test_links_are_resolved_as_the_sandbox_sees_them(view: SandboxFiles, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    os.symlink("/data/table.csv", workspace / "inside")
    os.symlink(str(tmp_path / "host-secret"), workspace / "host-path")
    os.symlink("../../..", workspace / "up")
    assert view.read("inside")[0] == b"a,b\n"
    for path in ("host-path", "up/etc/passwd", "../host-secret", "/etc/passwd"):
        with pytest.raises(FileAccessError, match="outside what the sandbox shares"):
            view.read(path)


def test_a_link_swapped_in_after_the_check_is_not_followed(
    view: SandboxFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failure injection: the resolution check is told the path is clean; the open must still refuse."""
    workspace = tmp_path / "ws"
    (workspace / "sub").mkdir()
    (workspace / "sub" / "f").write_text("fine")
    monkeypatch.setattr(SandboxFiles, "_first_symlink", lambda self, resolved: None)
    os.rename(workspace / "sub", workspace / "sub-real")
    os.symlink(str(tmp_path), workspace / "sub")  # now sub/ -> the host folder holding host-secret
    with pytest.raises(FileAccessError, match=r"changed into a link|symbolic link"):
        view.read("sub/host-secret")
    os.symlink(str(tmp_path / "host-secret"), workspace / "last")
    with pytest.raises(FileAccessError, match="symbolic link"):
        view.read("last")
    with pytest.raises(FileAccessError):
        view.write("last", b"overwrite the host?")
    assert (tmp_path / "host-secret").read_text() == "secret"


def test_a_link_swapped_out_while_being_resolved_is_a_refusal_not_a_crash(
    view: SandboxFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failure injection: the sandbox replaces the link with a file between the host's stat and readlink."""
    os.symlink("/data/table.csv", tmp_path / "ws" / "flipping")

    def swapped(path: str, *, dir_fd: int | None = None) -> str:
        raise OSError(22, "Invalid argument")  # what readlink says of what is no longer a link

    monkeypatch.setattr(os, "readlink", swapped)
    with pytest.raises(FileAccessError, match="changed while being looked up"):
        view.read("flipping")


def test_read_only_mounts_and_special_files(view: SandboxFiles, tmp_path: Path) -> None:
    with pytest.raises(FileAccessError, match="read-only mount /data"):
        view.write("/data/new.csv", b"x")
    os.mkfifo(tmp_path / "ws" / "pipe")
    with pytest.raises(FileAccessError, match="not a regular file"):
        view.read("pipe")
    assert view.write("deep/er/file.txt", b"made") == "/workspace/deep/er/file.txt"
    assert [entry.path for entry in view.list("deep", depth=2)] == ["/workspace/deep/er", "/workspace/deep/er/file.txt"]


@pytest.mark.parametrize(
    ("host", "needle"),
    [("/", "parent of $HOME or /"), ("~", "it is $HOME"), ("/nonexistent-folder", "does not exist")],
)
def test_home_root_and_missing_folders_are_refused(host: str, needle: str) -> None:
    with pytest.raises(MountError, match=needle.replace("$", r"\$")):
        resolve_mount(MountSpec(host=Path(host), sandbox="/data"), protected=[], identity=None)


def test_coderunner_state_and_system_paths_are_refused(tmp_path: Path) -> None:
    state = tmp_path / "state" / "workspaces"
    state.mkdir(parents=True)
    with pytest.raises(MountError, match="overlaps CodeRunner's own state"):
        resolve_mount(MountSpec(host=tmp_path / "state", sandbox="/data"), protected=[state], identity=None)
    for reserved in ("/usr/local/x", "/etc", "/workspace/sub", "/proc/x", "/tmp", "/opt/coderunner/env"):
        with pytest.raises(MountError, match="reserved"):
            check_sandbox_path(reserved)
    assert check_sandbox_path("/mnt/data/") == "/mnt/data"


def test_guest_arguments_are_confined_before_a_guest_sees_them(view: SandboxFiles, tmp_path: Path) -> None:
    os.symlink("/data", tmp_path / "ws" / "shared")
    arguments = {"output": "out.pdf", "inputs": ["a.pdf", "shared/table.csv"], "pages": "1-2"}
    confined = view.confine(arguments, ("output", "output_prefix", "inputs"))
    assert confined == {"output": "/workspace/out.pdf", "inputs": ["/workspace/a.pdf", "/data/table.csv"],
                        "pages": "1-2"}  # fmt: skip
    assert arguments["output"] == "out.pdf"  # the caller's dict is left as it was
    for escape in ({"output": "../host-secret"}, {"inputs": ["ok.pdf", "/etc/passwd"]}):
        with pytest.raises(FileAccessError, match="outside what the sandbox shares"):
            view.confine(escape, ("output", "inputs"))
