"""The pieces cheap one-shot runs are built from, on their own: the bash variables file and the
throwaway (tmpfs) workspace."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.hostfs.workspaces import Workspace
from coderunner.oneshot.program import OneShotError, bash_variables

HOSTILE = {
    "quote": "it's",
    "subst": "$(touch pwned) `touch pwned` ${HOME}",
    "lines": "one\ntwo\n",
    "backslash": "a\\'b\\",
    "unicode": "héllo ✓",
    "empty": "",
    "number": 4.5,
    "nothing": None,
    "items": [1, "two", {"three": 3}],
}


def test_bash_variables_reach_bash_exactly_and_run_nothing(tmp_path: Path) -> None:
    variables_file = tmp_path / "variables.sh"
    variables_file.write_bytes(bash_variables(HOSTILE))
    names = list(HOSTILE)
    script = 'for name in "$@"; do printf "%s\\0" "${!name}"; done; printf "%s" "${BASH_ENV-unset}"'
    done = subprocess.run(
        ["/bin/bash", "--norc", "--noprofile", "-c", script, "bash", *names],
        env={"PATH": "/usr/bin:/bin", "BASH_ENV": str(variables_file)},
        cwd=tmp_path, capture_output=True, check=True,
    )  # fmt: skip
    *values, rest = done.stdout.decode().split("\0")
    expected = [v if isinstance(v, str) else "" if v is None else json.dumps(v) for v in HOSTILE.values()]
    assert values == expected
    assert rest == "unset"  # a bash the script starts does not source the file again
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    ("variables", "needle"),
    [({"bad name": "x"}, "cannot be a bash variable"), ({"a": "x\0y"}, "NUL character")],
)
def test_bash_variables_refuse_what_bash_cannot_hold(variables: dict[str, str], needle: str) -> None:
    with pytest.raises(OneShotError, match=needle):
        bash_variables(variables)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="crw-", dir="/tmp"))
    yield path
    with open("/proc/self/mountinfo") as handle:
        for point in [line.split()[4] for line in handle if line.split()[4].startswith(str(path))]:
            subprocess.run(["umount", "-l", point], check=False)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def _mount_options(path: Path) -> str:
    with open("/proc/self/mountinfo") as handle:
        found = [line for line in handle if line.split()[4] == str(path)]
    return found[-1] if found else ""


@pytest.mark.skipif(os.getuid() != 0, reason="a capped workspace needs root (a mount)")
def test_a_throwaway_workspace_is_a_capped_tmpfs_and_goes_away(base: Path) -> None:
    workspace = Workspace.create(base / "w", 8, use_quota=True, throwaway=True)
    assert workspace.enforced_by == "tmpfs" and workspace.image is None
    line = _mount_options(workspace.path)
    assert " - tmpfs " in line and "nosuid" in line and "nodev" in line and "size=8192k" in line, line
    with pytest.raises(OSError) as full, open(workspace.path / "big", "wb") as handle:
        for _ in range(16):
            handle.write(b"\0" * 2**20)
            handle.flush()
            os.fsync(handle.fileno())
    assert full.value.errno == errno.ENOSPC
    workspace.remove()
    assert _mount_options(base / "w") == "" and not (base / "w").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="a capped workspace needs root (a mount)")
def test_only_throwaway_workspaces_are_tmpfs(base: Path) -> None:
    """Sessions keep the image (their files outlive a restart of the kernel, and RAM is not disk)."""
    uncapped = Workspace.create(base / "plain", None, use_quota=True, throwaway=True)
    assert uncapped.enforced_by is None and _mount_options(base / "plain") == ""
    uncapped.remove()
    session = Workspace.create(base / "session", 16, use_quota=True)
    try:
        assert session.enforced_by == "loop-mounted ext4 image"
    finally:
        session.remove()
    assert not (base / "session").exists()


def test_the_guest_package_is_installed_with_bytecode_the_sandbox_can_read(tmp_path: Path) -> None:
    """The sandbox cannot write bytecode, so the host compiles the guest once, with the sandbox's Python."""
    from coderunner.config import load_settings
    from coderunner.sandbox.bwrap import install_guest

    python = load_settings().sandbox_env / "bin" / "python"
    if not python.exists():
        pytest.skip("no sandbox environment here (coderunner setup)")
    tag = subprocess.run([str(python), "-c", "import sys; print(sys.implementation.cache_tag)"],
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    guest = install_guest(tmp_path, python)
    compiled = guest / "__pycache__" / f"oneshot.{tag}.pyc"
    assert compiled.is_file()
    assert compiled.stat().st_mode & 0o004 and (guest / "__pycache__").stat().st_mode & 0o005 == 0o005
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "coderunner_guest").symlink_to(guest)
    done = subprocess.run(
        [str(python), "-v", "-c", "import coderunner_guest.oneshot"],
        env={"PYTHONPATH": str(tmp_path / "lib"), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"code object from '{tmp_path / 'lib' / 'coderunner_guest' / '__pycache__' / compiled.name}'" in done.stderr
