"""`coderunner --help` and a bad argument answer without loading the MCP SDK, the settings or the sessions.

Importing those took seconds (issue 28); what is checked is what got imported, not how long it took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO

#: Modules only a chosen command needs: the SDK (mcp.types alone took about 2 s), the sessions, the settings.
HEAVY = ("mcp", "coderunner.sessions", "coderunner.config")

PROBE = """
import json, sys
from coderunner.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(name for name in sys.modules if any(name == p or name.startswith(p + ".") for p in {heavy!r}))
sys.stderr.write(json.dumps({{"code": code, "heavy": heavy}}) + "\\n")
"""


@pytest.mark.parametrize(
    ("argv", "code"),
    [(["--help"], 0), (["serve", "--help"], 0), (["serve", "--port", "not-a-number"], 2), (["nonsense"], 2)],
)
def test_help_and_bad_arguments_import_no_heavy_module(argv: list[str], code: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = json.loads(done.stderr.splitlines()[-1])
    assert found == {"code": code, "heavy": []}, done.stderr
