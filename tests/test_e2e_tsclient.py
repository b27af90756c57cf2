"""A client we did not write: the official MCP TypeScript SDK (pinned in tests/tsclient), over stdio and HTTP.

Each test plays one scenario of tests/tsclient/scenarios.mjs through harness.mjs and asserts on the JSON
it returns. A new scenario is one function there and one test here calling `play(...)`; a scenario that
needs a second client (another token) opens it with ctx.connect({token}).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coderunner.config import Settings
from coderunner.edge.client_configs import LaunchCommand, snippet

from .conftest import REPO, SERVER_CMD, TEST_TOKEN, ServerDirs, http_server, server_env

pytestmark = [pytest.mark.e2e]

TSCLIENT_DIR = Path(__file__).parent / "tsclient"
SDK_PACKAGE = TSCLIENT_DIR / "node_modules" / "@modelcontextprotocol" / "sdk" / "package.json"
NPM_TIMEOUT_S = 600
SCENARIO_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def node() -> str:
    """Node.js with the pinned SDK (tests/tsclient/package-lock.json), installed with `npm ci` on first use."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "the TypeScript SDK tests need Node.js and npm (Debian: apt-get install nodejs npm)"
    if not SDK_PACKAGE.exists():
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=TSCLIENT_DIR,
            check=True,
            timeout=NPM_TIMEOUT_S,
        )
    return node


@pytest.fixture(params=["stdio", "http"])
def ts_transport(request: pytest.FixtureRequest) -> str:
    return request.param


@contextlib.contextmanager
def server_spec(transport: str, env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """How harness.mjs reaches a server: it starts one over stdio, or joins one started here over HTTP."""
    if transport == "stdio":
        yield {"transport": "stdio", "command": SERVER_CMD[0], "args": SERVER_CMD[1:], "env": env}
        return
    with http_server(env) as url:
        yield {"transport": "http", "url": url, "token": TEST_TOKEN}


def play(node: str, scenario: str, spec: dict[str, Any], **params: Any) -> Any:
    """Run one scenario; its result, or a failure carrying the harness's error and the server's log."""
    done = subprocess.run(
        [node, str(TSCLIENT_DIR / "harness.mjs"), json.dumps({**spec, "scenario": scenario, "params": params})],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=SCENARIO_TIMEOUT_S,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"the harness printed nothing (exit {done.returncode}): {done.stderr[-3000:]}"
    answer = json.loads(lines[-1])
    assert answer["ok"], f"{scenario} failed: {answer['error']}\n{done.stderr[-3000:]}"
    return answer["result"]


@pytest.fixture
def spec(ts_transport: str, dirs: ServerDirs) -> Iterator[dict[str, Any]]:
    with server_spec(ts_transport, server_env(dirs)) as found:
        yield found


def test_state_persists_across_calls(node: str, spec: dict[str, Any]) -> None:
    result = play(node, "state", spec)
    assert result["second"].splitlines()[0] == "42" and not result["isError"]


def test_a_chart_is_an_image_block(node: str, spec: dict[str, Any]) -> None:
    result = play(node, "chart", spec)
    images = [block for block in result["blocks"] if block["type"] == "image"]
    assert len(images) == 1, result
    assert images[0]["mimeType"] == "image/png" and images[0]["head"] == "89504e470d0a1a0a"
    assert images[0]["bytes"] > 1000 and "cannot be shown" not in result["text"]


def test_progress_notifications_keep_a_short_request_alive(node: str, spec: dict[str, Any]) -> None:
    """A 2 s request timeout with resetTimeoutOnProgress outlives a 3 s cell (docs/clients-and-http.md's advice)."""
    result = play(node, "progress", spec)
    assert not result["isError"] and "'done'" in result["text"]
    assert len(result["progress"]) >= 2
    assert all(note["total"] == Settings.model_fields["timeout_s"].default for note in result["progress"])
    assert any("step" in (note.get("message") or "") for note in result["progress"])


def test_abort_signal_interrupts_the_cell_and_keeps_state(node: str, spec: dict[str, Any]) -> None:
    result = play(node, "cancel", spec)
    assert result["progressed"] >= 1 and result["abortError"], result
    assert not result["isError"] and "('still here', True)" in result["after"], result


def test_a_timed_out_cell_answers_before_the_sdk_gives_up(node: str, dirs: ServerDirs) -> None:
    """Scaled down (a 3 s timeout_s), plus the default detach's margin under the SDK's own request timeout."""
    with server_spec("stdio", server_env(dirs, CODERUNNER_TIMEOUT_S="3")) as found:
        result = play(node, "timeout", found)
    assert result["timedOutIsError"] and "interrupted; the kernel and its state are kept" in result["timedOut"]
    assert result["after"].splitlines()[0] == "'kept'"
    # Unscaled, a longer cell answers at detach_after_s (a job id) before the SDK gives up, with a margin.
    assert Settings.model_fields["detach_after_s"].default + 5 < result["sdkDefaultTimeoutMs"] / 1000


def test_resource_reads_have_their_mime_type(node: str, spec: dict[str, Any]) -> None:
    result = play(node, "resources", spec)
    assert result["png"]["mimeType"] == "image/png" and result["png"]["blobHead"] == "89504e470d0a1a0a"
    assert result["csv"] == {"mimeType": "text/csv", "text": "x,y\n1,2\n", "blobHead": None}
    assert [template["uriTemplate"] for template in result["templates"]] == ["sandbox://{session_id}/{+path}"]


def test_a_second_client_sees_neither_variables_nor_sessions_of_the_first(node: str, dirs: ServerDirs) -> None:
    """Over HTTP, one server and one token: another MCP session is another client."""
    with server_spec("http", server_env(dirs)) as found:
        result = play(node, "two_clients", found)
    assert result["peekIsError"] and "NameError" in result["peek"]
    assert not result["firstSessionListed"]


def test_two_tokens_never_see_each_others_variables_or_sessions(node: str, dirs: ServerDirs) -> None:
    """Two bearer tokens are two clients: the TypeScript SDK as the second cannot read, list or borrow."""
    env = server_env(dirs)
    added = subprocess.run([*SERVER_CMD[:-1], "token", "add", "bob"], env=env, capture_output=True, text=True,
                           timeout=60, cwd=str(REPO))  # fmt: skip
    assert added.returncode == 0, added.stderr[-2000:]
    second = added.stdout.strip().splitlines()[-1]
    with server_spec("http", env) as found:
        result = play(node, "two_clients", found, second={"token": second})
    assert result["peekIsError"] and "NameError" in result["peek"]
    assert not result["firstSessionListed"]
    # Answered as an id that never existed: a live id of another client is not told apart.
    assert result["borrowedIsError"] and "unknown or expired session_id" in result["borrowed"], result["borrowed"]


def test_the_sdk_accepts_every_tool(node: str, spec: dict[str, Any]) -> None:
    result = play(node, "tools", spec)
    seed = {"run_python", "kernel_reset", "browser_navigate", "browser_extract", "pdf_ops", "image_ops"}
    assert {*seed, "read_file", "execute_code"} <= set(result["names"])
    assert result["compiled"] == dict.fromkeys(result["names"], "ok")
    assert result["runPythonAcceptsCode"] and result["runPythonRefusesNoCode"]
    assert result["called"].splitlines()[0] == "45"


def test_the_config_snippet_for_typescript_runs_as_printed(node: str, dirs: ServerDirs, tmp_path: Path) -> None:
    """`coderunner config typescript --url URL` is a program: run it with the pinned SDK and the token."""
    env = server_env(dirs)
    (tmp_path / "node_modules").symlink_to(TSCLIENT_DIR / "node_modules")
    with http_server(env) as url:
        program = tmp_path / "agent.mjs"
        program.write_text(snippet("typescript", LaunchCommand.for_install(url), url))
        done = subprocess.run([node, str(program)], env={"PATH": env["PATH"], "CODERUNNER_TOKEN": TEST_TOKEN},
                              capture_output=True, text=True, timeout=SCENARIO_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "42"


def test_snapshot_fork_and_restore_through_the_typescript_sdk(node: str, spec: dict[str, Any]) -> None:
    result = play(node, "snapshots", spec)
    assert {"weights", "score"} <= set(result["taken"]["variables"]) and "np" in result["taken"]["modules"]
    assert {"weights", "score"} <= set(result["restored"]["restored"]) <= set(result["forked"]["restored"])
    # The fork zeroed its own weights; the original and the restored copy kept theirs.
    assert result["original"].splitlines()[0] == "30" and result["inRestored"].splitlines()[0] == "30"
    assert result["inFork"].splitlines()[0] == "0"
    assert [entry["snapshot"] for entry in result["listed"]["snapshots"]] == [result["taken"]["snapshot"]]
