"""One image build at a time across pytest's workers: each worker has its own session fixtures.

Two workers reaching the podman or the Apple stand-in's image at once would build the same base and
tag side by side; the second to take this lock finds the image current and builds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: One lock per checkout (a machine may hold several), in /tmp like the tests' other runtime folders.
LOCK_PATH = Path("/tmp") / f"coderunner-tests-images-{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}.lock"


@contextlib.contextmanager
def image_build_lock() -> Iterator[None]:
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build is bounded by its own timeout, so this wait is too
        yield
    finally:
        os.close(fd)
