"""The dirs sweeper (hostfs/dirs_sweeper.py), as a real process: it sweeps once its manager's pipe ends
without the word that the manager closed in order, and it never takes a dir whose lock a live server holds."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from coderunner.hostfs.dirs_sweeper import SWEEP_PAUSES_S, DirsSweeper


def _session(tmp_path: Path, key: str) -> tuple[Path, Path, Path]:
    """A session's dirs as a server leaves them: RUNTIME/<key> with its lock file, WORKSPACES/<key> with a file."""
    runtime, workspaces = tmp_path / "r", tmp_path / "w"
    (runtime / key).mkdir(parents=True)
    (runtime / key / "lock").write_text("")
    (workspaces / key).mkdir(parents=True)
    (workspaces / key / "data.txt").write_text("the session's")
    return runtime, workspaces, runtime / key / "lock"


def _within(seconds: float, done: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_manager_that_died_has_its_dead_dirs_swept_and_a_live_servers_kept(tmp_path: Path) -> None:
    runtime, workspaces, _ = _session(tmp_path, "0a0a0a0a")
    _, _, live_lock = _session(tmp_path, "0b0b0b0b")
    held = os.open(live_lock, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # another server, alive: its dirs are its own
    sweeper = DirsSweeper(runtime, workspaces)
    try:
        assert sweeper.process is not None
        sweeper.close(in_order=False)  # as the end of a killed process's pipe
        assert _within(SWEEP_PAUSES_S[0] + 10, lambda: not (runtime / "0a0a0a0a").exists()), os.listdir(runtime)
        assert not (workspaces / "0a0a0a0a").exists()
        assert (runtime / "0b0b0b0b").exists() and (workspaces / "0b0b0b0b" / "data.txt").exists()
        # Nothing dead is left (the live server's dir is not its to take): it exits, its later sweeps unneeded.
        assert sweeper.process.wait(timeout=SWEEP_PAUSES_S[1]) == 0
        assert (runtime / "0b0b0b0b").exists()
    finally:
        os.close(held)
        if sweeper.process is not None:
            sweeper.process.kill()
            sweeper.process.wait(timeout=10)


def test_a_manager_that_closed_in_order_lets_its_sweeper_go_at_once(tmp_path: Path) -> None:
    runtime, workspaces, _ = _session(tmp_path, "0c0c0c0c")
    sweeper = DirsSweeper(runtime, workspaces)
    assert sweeper.process is not None
    sweeper.close(in_order=True)
    assert sweeper.process.wait(timeout=10) == 0
    assert (runtime / "0c0c0c0c").exists()  # nothing of its own was left; what is there is not its to take


def test_the_sweepers_command_line_names_no_dir(tmp_path: Path) -> None:
    """Tests and tools find a server's sandboxes by their runtime dir in a command line: the sweeper is none."""
    runtime, workspaces, _ = _session(tmp_path, "0d0d0d0d")
    sweeper = DirsSweeper(runtime, workspaces)
    assert sweeper.process is not None
    try:
        cmdline = Path(f"/proc/{sweeper.process.pid}/cmdline").read_bytes()
        assert str(runtime).encode() not in cmdline and str(workspaces).encode() not in cmdline
    finally:
        sweeper.close(in_order=True)
        sweeper.process.wait(timeout=10)
