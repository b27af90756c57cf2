"""How `coderunner setup` builds the compiled init and how a server finds it (sandbox/init_binary.py): only a
binary of this very source is ever used, and a machine without a compiler keeps the Python init, warned."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coderunner.config import Settings
from coderunner.sandbox import init_binary
from coderunner.sandbox.bwrap_doctor import check_sandbox_init


def test_a_binary_built_from_another_source_is_never_used(tmp_path: Path) -> None:
    stale = tmp_path / init_binary.LIBEXEC / "sandbox-init-000000000000"
    stale.parent.mkdir()
    stale.write_bytes(b"\x7fELF")
    stale.chmod(0o755)
    assert init_binary.binary_name() != stale.name
    assert init_binary.installed(tmp_path) is None


def test_no_compiler_keeps_the_python_init_and_says_how_to_get_the_compiled_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert init_binary.build(tmp_path, compiler="no-such-compiler-here") is None
    assert "no C compiler" in capsys.readouterr().err
    assert init_binary.installed(tmp_path) is None


def test_a_failing_compile_leaves_nothing_behind_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both flag sets tried (static, then dynamic); the compiler's last line is the reason; no half-made file."""
    failing = tmp_path / "bin" / "cc-that-fails"
    failing.parent.mkdir()
    failing.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\necho \'no libc here\' >&2\nexit 1\n')
    failing.chmod(0o755)
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    assert init_binary.build(env_dir, compiler=str(failing)) is None
    calls = (failing.parent / "calls").read_text().splitlines()
    assert ["-static" in call for call in calls] == [True, False]
    assert "no libc here" in capsys.readouterr().err
    assert os.listdir(env_dir / init_binary.LIBEXEC) == []


def test_a_built_init_is_kept_and_found_by_its_source(tmp_path: Path) -> None:
    built = init_binary.build(tmp_path)
    if built is None:
        pytest.skip("no C compiler on this machine")
    assert built.name == init_binary.binary_name() and os.access(built, os.X_OK)
    made = built.stat().st_mtime_ns
    assert init_binary.build(tmp_path) == built and built.stat().st_mtime_ns == made  # not built again
    assert init_binary.installed(tmp_path) == built


def test_doctor_says_which_init_a_sandbox_gets(tmp_path: Path) -> None:
    """Compiled where setup built this source's, else the Python one, with how to get the compiled one."""
    stale = tmp_path / init_binary.LIBEXEC / "sandbox-init-000000000000"
    stale.parent.mkdir()
    stale.write_bytes(b"")
    stale.chmod(0o755)
    missing = check_sandbox_init(Settings(sandbox_env=tmp_path))
    assert missing.ok and missing.detail.startswith("Python: no compiled init") and "gcc" in (missing.fix or "")
    built = tmp_path / init_binary.LIBEXEC / init_binary.binary_name()
    built.write_bytes(b"")
    built.chmod(0o755)
    assert check_sandbox_init(Settings(sandbox_env=tmp_path)).detail == f"compiled ({built.name})"
    off = check_sandbox_init(Settings(sandbox_env=tmp_path, compiled_init=False))
    assert off.detail.startswith("Python (compiled_init false)")
