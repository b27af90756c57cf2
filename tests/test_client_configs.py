"""The client snippets: `coderunner config CLIENT`, the files in examples/, and the example agent."""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from coderunner.cli import _parser
from coderunner.edge.client_code import LIBRARY_CLIENTS
from coderunner.edge.client_configs import APP_CLIENTS, LaunchCommand, cline_settings_path, proxy_args, snippet

from .conftest import REPO, TEST_TOKEN, ServerDirs, http_server, server_env

EXAMPLES = REPO / "examples"
PLACEHOLDER = LaunchCommand("/path/to/coderunner/.venv/bin/coderunner", ("serve",))
EXAMPLE_FILES = {
    "claude_desktop_config.json": ("claude-desktop", PLACEHOLDER),
    "claude_desktop_proxy_config.json": (
        "claude-desktop",
        LaunchCommand(PLACEHOLDER.command, proxy_args("http://127.0.0.1:8765/mcp", "claude-desktop")),
    ),
    "cursor-mcp.json": ("cursor", PLACEHOLDER),
    "windsurf-mcp_config.json": ("windsurf", PLACEHOLDER),
    "zed-settings.json": ("zed", PLACEHOLDER),
    "continue-config.yaml": ("continue", PLACEHOLDER),
    "cline_mcp_settings.json": ("cline", PLACEHOLDER),
}


@pytest.mark.parametrize("name", sorted(EXAMPLE_FILES))
def test_example_files_are_what_the_config_command_prints(name: str) -> None:
    client, launch = EXAMPLE_FILES[name]
    assert (EXAMPLES / name).read_text() == snippet(client, launch) + "\n"


def test_claude_code_example_is_the_printed_command() -> None:
    assert snippet("claude-code", PLACEHOLDER) in (EXAMPLES / "claude-code.sh").read_text().splitlines()


@pytest.mark.parametrize("client", APP_CLIENTS)
def test_config_command_names_this_install_and_a_command_that_starts(client: str) -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "config", client], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    command, args = launched(client, printed.stdout)
    assert Path(command).is_absolute() and Path(command).exists()
    assert args[-1] == "serve"
    started = subprocess.run([command, *args[:-1], "--help"], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0 and "serve" in started.stdout


def launched(client: str, text: str) -> tuple[str, list[str]]:
    """The command and arguments an app's snippet makes it launch."""
    if client == "claude-code":
        argv = shlex.split(text)
        return argv[argv.index("--") + 1], argv[argv.index("--") + 2 :]
    if client == "continue":
        lines = [line.strip() for line in text.splitlines()]
        return json.loads(lines[2].removeprefix("command: ")), [json.loads(line[2:]) for line in lines[4:]]
    servers = json.loads(text)["context_servers" if client == "zed" else "mcpServers"]
    return servers["coderunner"]["command"], servers["coderunner"]["args"]


@pytest.mark.parametrize("client", APP_CLIENTS)
def test_config_command_for_a_shared_server_uses_the_proxy_with_a_stable_client_name(client: str) -> None:
    """Without --client each proxy process is a new client: its named workspaces seem gone after a restart."""
    url = "http://127.0.0.1:9999/mcp"
    printed = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "config", client, "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    _command, args = launched(client, printed.stdout)
    proxy = _parser().parse_args(args[args.index("proxy") :])
    assert (proxy.command, proxy.url, proxy.client_name) == ("proxy", url, client)


def test_cline_gets_its_own_keys_and_is_told_which_file() -> None:
    """Cline (VS Code) reads mcpServers from its own settings file, with its switch and auto-approve list."""
    printed = subprocess.run(
        [sys.executable, "-m", "coderunner.cli", "config", "cline"], capture_output=True, text=True, timeout=60
    )
    assert printed.returncode == 0, printed.stderr
    entry = json.loads(printed.stdout)["mcpServers"]["coderunner"]
    assert entry["disabled"] is False and entry["autoApprove"] == []  # the user decides what runs unasked
    assert set(entry) == {"command", "args", "disabled", "autoApprove"}
    assert printed.stderr.startswith("# goes into: ") and "cline_mcp_settings.json" in printed.stderr
    assert cline_settings_path() in printed.stderr and "Configure MCP Servers" in printed.stderr


@pytest.mark.parametrize(
    ("platform", "folder"),
    [
        ("linux", "~/.config/Code/User/globalStorage/"),
        ("darwin", "~/Library/Application Support/Code/User/globalStorage/"),
        ("win32", "%APPDATA%\\Code\\User\\globalStorage\\"),
    ],
)
def test_clines_settings_file_is_in_vs_codes_global_storage(platform: str, folder: str) -> None:
    path = cline_settings_path(platform)
    assert path.startswith(folder) and "saoudrizwan.claude-dev" in path
    assert path.endswith("cline_mcp_settings.json") and "settings" in path.split(folder)[1]


#: What each library's snippet must set, beyond where the server is (see client_code.py).
LIBRARY_SETTINGS = {
    "openai-agents": ("client_session_timeout_seconds=60",),
    "pydantic-ai": ("max_retries=5", "read_timeout="),
    "langchain": ("client.session(", "load_mcp_tools(session)", 'file_links = "text"'),
    "typescript": ("resetTimeoutOnProgress: true", "onprogress", "detach_after_s"),
}


@pytest.mark.parametrize("url", [None, "http://127.0.0.1:9999/mcp"])
@pytest.mark.parametrize("client", LIBRARY_CLIENTS)
def test_library_snippets_set_what_matters_and_parse(client: str, url: str | None) -> None:
    argv = [sys.executable, "-m", "coderunner.cli", "config", client] + (["--url", url] if url else [])
    printed = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    text = printed.stdout
    for setting in LIBRARY_SETTINGS[client]:
        assert setting in text, (setting, text)
    if url:
        assert url in text and "CODERUNNER_TOKEN" in text and TEST_TOKEN not in text
        if client != "typescript":  # the command that prints the token is this install's, not a bare name
            assert f'CODERUNNER_TOKEN="$({Path(sys.executable).parent / "coderunner"} token)"' in text, text
    else:
        assert '"serve"' in text and str(Path(sys.executable).parent) in text
    if client != "typescript":  # that one runs for real in test_e2e_tsclient.py
        compile(text, client, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.e2e
def test_example_agent_runs_its_plan_over_stdio_and_http(dirs: ServerDirs, tmp_path: Path) -> None:
    env = server_env(dirs)
    over_stdio = subprocess.run(
        [sys.executable, str(EXAMPLES / "agent.py"), "--out", str(tmp_path / "stdio")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert over_stdio.returncode == 0, over_stdio.stderr[-2000:]
    assert "step 1: 10000" in over_stdio.stdout and "most common total: 7" in over_stdio.stdout
    assert (tmp_path / "stdio" / "step3.png").read_bytes().startswith(b"\x89PNG")
    with http_server(env) as url:
        wrong_token = subprocess.run(
            [sys.executable, str(EXAMPLES / "agent.py"), "--url", url, "--token", "not-the-token",
             "--out", str(tmp_path / "refused")],
            capture_output=True,
            text=True,
            timeout=180,
        )  # fmt: skip
        said = (wrong_token.stdout + wrong_token.stderr).strip()
        assert wrong_token.returncode == 1 and len(said.splitlines()) == 1, said[-3000:]
        assert "401" in said and "--token" in said and "coderunner token" in said, said
        over_http = subprocess.run(
            [sys.executable, str(EXAMPLES / "agent.py"), "--url", url, "--token", TEST_TOKEN,
             "--out", str(tmp_path / "http")],
            capture_output=True,
            text=True,
            timeout=180,
        )  # fmt: skip
    assert over_http.returncode == 0, over_http.stderr[-2000:]
    assert (tmp_path / "http" / "step3.png").read_bytes().startswith(b"\x89PNG")
