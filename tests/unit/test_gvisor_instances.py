"""Servers sharing a runtime dir on gvisor: one's start-up sweep never takes another's instance dir
for dead (issue 25, finding 6, the gvisor backend's own dir per server process)."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from coderunner.sandbox.gvisor import ABANDONED_AFTER_S, LOCK_NAME, NEW_INSTANCE, GvisorBackend


def bare_backend(backend_dir: Path) -> GvisorBackend:
    """Just what _new_instance and _instances use: no runsc, podman or image needed."""
    backend = object.__new__(GvisorBackend)
    backend.backend_dir = backend_dir
    backend.instance = backend._new_instance()
    return backend


def test_an_instance_dir_appears_only_with_its_lock_held(tmp_path: Path) -> None:
    first = bare_backend(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [first.instance.name]  # no temporary name left behind
    second = bare_backend(tmp_path)
    # Each sees the other alive: its lock is held from the moment the dir has its name.
    assert second._instances() == [(first.instance.top, True)]
    assert first._instances() == [(second.instance.top, True)]
    probe = os.open(first.instance.top / LOCK_NAME, os.O_RDWR)
    try:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError("the lock of a live instance could be taken")
        except BlockingIOError:
            pass
    finally:
        os.close(probe)


def test_a_dir_being_made_is_alive_until_its_maker_is_long_gone(tmp_path: Path) -> None:
    sweeper = bare_backend(tmp_path)
    making = tmp_path / f"{NEW_INSTANCE}0123456789ab"
    making.mkdir(mode=0o700)  # a server caught between mkdir and its lock
    assert (making, True) in sweeper._instances()
    old = time.time() - ABANDONED_AFTER_S - 60
    os.utime(making, (old, old))  # its maker died long ago
    assert (making, False) in sweeper._instances()
    dead = tmp_path / f"{NEW_INSTANCE}ba9876543210"
    dead.mkdir(mode=0o700)
    (dead / LOCK_NAME).touch()  # a lock nobody holds: its maker died
    assert (dead, False) in sweeper._instances()
