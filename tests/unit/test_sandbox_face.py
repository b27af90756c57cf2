"""The sandbox package's face: a registry of backends by name, each imported only when chosen."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

from coderunner.config import Backend
from coderunner.sandbox import BACKENDS


def test_every_configurable_backend_is_registered() -> None:
    assert set(BACKENDS) == set(get_args(Backend))


def test_importing_the_face_loads_no_backend() -> None:
    probe = (
        "import sys, coderunner.sandbox, coderunner.sessions; "
        "print(sorted(m for m in sys.modules if m.split('.')[-1] in ('bwrap', 'oci', 'apple', 'container')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
