"""execute_code (check_only too), variables, install_packages and get_capabilities through the MCP client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp import Client

from .conftest import (
    SECRET_NAME,
    SECRET_VALUE,
    ServerDirs,
    json_of,
    memory_client,
    run,
    run_to_end,
    sandbox_processes_alive,
    server_env,
    text_of,
    wait_until,
)

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    """In memory: these tools are transport-blind (test_e2e_transports.py covers the transports).
    The user allows network 'internet' here (test_network_flag, install_packages). Each run starts its
    own sandbox here (oneshot_ready off, so a test may count what a run leaves): test_e2e_oneshot_ready.py
    collects these scenarios again with sandboxes started ahead, the default."""
    env = server_env(dirs, CODERUNNER_MAX_NETWORK="internet", CODERUNNER_ONESHOT_READY="0")
    async with memory_client(env) as connected:
        yield connected


#: Every JSON type, and a string that is source code in each language.
VALUES: dict[str, Any] = {
    "text": "héllo wörld",
    "count": 42,
    "ratio": 2.5,
    "flag": True,
    "nothing": None,
    "items": [1, "two", 3.0],
    "table": {"a": 1, "b": [True, None]},
    "code": "'); import os; os.system('touch pwned') #\"; require('fs').writeFileSync('pwned','x'); "
    "$(touch pwned) `touch pwned`",
}


async def execute(client: Client, language: str, code: str, **arguments: Any) -> dict[str, Any]:
    """The run's answer (followed to its end if it went on as a job: a loaded machine)."""
    result = (await run_to_end(client, code, "execute_code", language=language, **arguments))[-1]
    payload = json_of(result)
    assert payload is not None, text_of(result)
    assert result.is_error == (not payload["success"])
    return payload


async def refused(client: Client, tool: str, arguments: dict[str, Any], *needles: str) -> None:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, text_of(result)
    for needle in needles:
        assert needle in text_of(result), text_of(result)


PROGRAMS = {
    "python": "import sys\nprint('got', sys.stdin.read().strip(), count + 1)\nsys.exit(3)",
    "javascript": "const input = require('fs').readFileSync(0, 'utf8').trim();\n"
    "console.log('got', input, count + 1);\nprocess.exit(3);",
    "bash": 'read -r line\necho "got $line $((count + 1))"\nexit 3',
}


@pytest.mark.parametrize("language", ["python", "javascript", "bash"])
async def test_each_language_reads_stdin_sees_variables_and_reports_its_exit_code(
    client: Client, language: str
) -> None:
    done = await execute(client, language, PROGRAMS[language], stdin="ping\n", variables='{"count": 41}')
    assert done["stdout"].strip() == "got ping 42"
    assert done["exit_code"] == 3 and done["success"] is False and done["timed_out"] is False
    assert done["language"] == language and done["execution_time_ms"] > 0
    ok = await execute(client, language, {"python": "print('fine')", "javascript": "console.log('fine')",
                                          "bash": "echo fine"}[language])  # fmt: skip
    assert ok["success"] is True and ok["exit_code"] == 0 and ok["stdout"] == "fine\n"


async def test_variables_of_every_json_type_arrive_as_data(client: Client) -> None:
    python = await execute(
        client, "python",
        "import json, os\nprint(json.dumps([text, count, ratio, flag, nothing, items, table, code]))\n"
        "print(os.path.exists('pwned'))", variables=json.dumps(VALUES),
    )  # fmt: skip
    lines = python["stdout"].splitlines()
    assert json.loads(lines[0]) == list(VALUES.values())
    assert lines[1] == "False"
    javascript = await execute(
        client, "javascript", "console.log(JSON.stringify([text, count, ratio, flag, nothing, items, table, code]));"
        "console.log(require('fs').existsSync('pwned'))", variables=json.dumps(VALUES),
    )  # fmt: skip
    lines = javascript["stdout"].splitlines()
    assert json.loads(lines[0]) == list(VALUES.values())
    assert lines[1] == "false"
    bash = await execute(
        client, "bash", 'printf "%s\\n" "$text" "$count" "$ratio" "$flag" "[$nothing]" "$items" "$table" "$code"\n'
        "test -e pwned && echo PWNED || echo clean", variables=json.dumps(VALUES),
    )  # fmt: skip
    assert bash["stdout"].splitlines() == [
        VALUES["text"], "42", "2.5", "true", "[]", json.dumps(VALUES["items"]), json.dumps(VALUES["table"]),
        VALUES["code"], "clean",
    ]  # fmt: skip


async def test_run_python_variables_arrive_as_data_and_persist(client: Client) -> None:
    result = await run(client, "import os\n(count + 1, items, code == CODE, os.path.exists('pwned'))",
                       variables=json.dumps({**VALUES, "CODE": VALUES["code"]}))  # fmt: skip
    assert not result.is_error, text_of(result)
    assert "(43, [1, 'two', 3.0], True, False)" in text_of(result)
    assert "{'a': 1, 'b': [True, None]}" in text_of(await run(client, "table"))
    names = await run(client, "sorted(k for k in globals() if 'dispatch' in k or 'coderunner' in k)")
    assert "[]" in text_of(names)


@pytest.mark.parametrize(
    ("name", "language", "why"),
    [
        ("x; import os", "python", "not an identifier"),
        ("1abc", "javascript", "not an identifier"),
        ("a-b", "bash", "not an identifier"),
        ("__import__", "python", "dunder"),
        ("__proto__", "javascript", "dunder"),
        ("class", "python", "reserved word"),
        ("function", "javascript", "reserved word"),
        ("PATH", "bash", "change how bash"),
        ("BASH_ENV", "bash", "change how bash"),
        ("LD_PRELOAD", "bash", "change how bash"),
        ("IFS", "bash", "change how bash"),
    ],
)
async def test_injection_through_variable_names_is_refused(client: Client, name: str, language: str, why: str) -> None:
    arguments = {"language": language, "code": "true", "variables": json.dumps({name: 1})}
    await refused(client, "execute_code", arguments, name, why)


async def test_variables_are_json_object_text_and_bad_text_is_explained(client: Client) -> None:
    await refused(client, "run_python", {"code": "1", "variables": "{n: 1}"}, "variables is not valid JSON", '{"n": 3}')
    await refused(client, "run_python", {"code": "1", "variables": "[1, 2]"}, "not a JSON array")
    await refused(client, "execute_code", {"language": "bash", "code": "true", "variables": '{"x": NaN}'}, "NaN")
    # A client that still sends an object, or null, is served all the same.
    assert text_of(await run(client, "n * 2", variables={"n": 21})).splitlines()[0] == "42"
    assert text_of(await run(client, "n + 1", variables=None)).splitlines()[0] == "22"
    assert text_of(await run(client, "n + 2", variables="")).splitlines()[0] == "23"


async def test_run_python_refuses_bad_names_and_keeps_serving(client: Client) -> None:
    await refused(client, "run_python", {"code": "1", "variables": '{"__builtins__": {}}'}, "dunder")
    await refused(client, "run_python", {"code": "1", "variables": '{"a b": 1}'}, "not an identifier")
    assert text_of(await run(client, "1 + 1")).splitlines()[0] == "2"


@pytest.mark.parametrize(
    ("language", "forever"),
    [("python", "while True:\n    pass"), ("javascript", "for (;;) {}"), ("bash", "while :; do :; done")],
)
async def test_timeouts_kill_the_run_and_leave_nothing(
    client: Client, dirs: ServerDirs, language: str, forever: str
) -> None:
    done = await execute(client, language, forever, timeout_s=1.5)
    assert done["timed_out"] is True and done["success"] is False and done["exit_code"] is None
    assert "timed out after 1.5s" in done["stderr"]
    assert await wait_until(lambda: not sandbox_processes_alive(dirs), timeout_s=10)
    # Its dirs go just after the reply.
    assert await wait_until(lambda: not dirs.session_runtime_dirs())
    assert text_of(await run(client, "'still serving'")).startswith("'still serving'")


HUNGRY = {
    "python": "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))",
    "javascript": "const blocks = [];\nfor (;;) { blocks.push(Buffer.alloc(50 * 2**20, 1)); }",
    "bash": 'x=a\nwhile :; do x="$x$x"; done',
}


@pytest.mark.parametrize("language", ["python", "javascript", "bash"])
async def test_memory_limits_hold_per_language(client: Client, language: str) -> None:
    done = await execute(client, language, HUNGRY[language], memory_mb=512, timeout_s=60)
    assert done["success"] is False and done["timed_out"] is False
    assert done["limits"]["memory_mb"] == 512
    if done["memory_peak_mb"] is not None:  # where a memory cgroup measures it
        assert done["memory_peak_mb"] <= 512 + 16
    said = done["stderr"].lower()
    assert any(word in said for word in ("memoryerror", "memory", "allocat", "killed")), done["stderr"][-2000:]
    fine = await execute(client, language, {"python": "print(1)", "javascript": "console.log(1)",
                                            "bash": "echo 1"}[language], memory_mb=512)  # fmt: skip
    assert fine["success"] is True


async def test_memory_peak_is_measured(client: Client) -> None:
    done = await execute(client, "python", "block = bytearray(200 * 2**20)\nprint(len(block))")
    assert done["success"] is True
    held = json_of(await client.call_tool("get_capabilities", {}))["limits"]["memory_mb"]["enforced_by"]
    if held and "cgroup" in held:
        assert done["memory_peak_mb"] is not None and done["memory_peak_mb"] >= 190


async def test_network_flag(client: Client) -> None:
    probe = (
        "import socket\ntry:\n    socket.create_connection(('pypi.org', 443), timeout=10).close(); print('reached')\n"
        "except OSError as exc:\n    print('blocked', type(exc).__name__)"
    )
    off = await execute(client, "python", probe)
    assert off["stdout"].startswith("blocked")
    on = await execute(client, "python", probe, network="internet")
    assert on["stdout"].strip() == "reached", on


async def test_the_host_environment_never_reaches_a_one_shot_run(client: Client) -> None:
    for language, code in (
        ("python", "import os; print(dict(os.environ))"),
        ("javascript", "console.log(JSON.stringify(process.env))"),
        ("bash", "env; cat /proc/1/environ"),
    ):
        done = await execute(client, language, code)
        assert SECRET_VALUE not in done["stdout"] and SECRET_NAME not in done["stdout"]


async def test_background_processes_die_with_the_run(client: Client, dirs: ServerDirs) -> None:
    done = await execute(client, "bash", "(sleep 300 &) ; nohup sleep 301 >/dev/null 2>&1 &\necho started")
    assert done["stdout"] == "started\n"
    assert await wait_until(lambda: not sandbox_processes_alive(dirs), timeout_s=10)


async def test_output_is_bounded(client: Client) -> None:
    done = await execute(client, "bash", "head -c 50000000 /dev/zero | tr '\\0' 'x'; echo; echo END")
    assert done["truncated"] is True and done["success"] is True
    assert len(done["stdout"]) < 30_000 and done["stdout"].rstrip().endswith("END")
    assert "bytes omitted" in done["stdout"]


async def test_a_fork_bomb_is_contained_and_the_server_serves(client: Client) -> None:
    # The script forks once, `bomb &`, before any bomb exists, then waits and speaks by builtins only. Any later fork
    # of its own races the bomb for the last pids, and bash gives up on a fork after its retries and exits 254 (seen
    # in CI on a loaded machine twice: with a `sleep`, and with `bomb` called in the script itself, whose
    # background pipeline the script forks twice, the second fork after the first side already bombs).
    wait_3s = "SECONDS=0; while [ $SECONDS -lt 3 ]; do :; done"
    done = await execute(client, "bash", f"bomb() {{ bomb | bomb & }}; bomb & {wait_3s}; echo survived", timeout_s=20)
    # The pids limit makes forks fail; the run itself goes on and ends in time.
    assert done["timed_out"] is False and "survived" in done["stdout"], done
    assert "fork" in done["stderr"] or "Resource temporarily unavailable" in done["stderr"], done["stderr"][-500:]
    assert text_of(await run(client, "'serving'")).startswith("'serving'")


@pytest.mark.parametrize(
    ("language", "code", "line", "column"),
    [
        ("python", "x = 1\ndef broken(:\n    pass\n", 2, 12),
        ("javascript", "const a = 1;\nlet b = ;\n", 2, 9),
        ("bash", "echo ok\nif then\nfi\n", 2, None),
    ],
)
async def test_syntax_errors_per_language(
    client: Client, language: str, code: str, line: int, column: int | None
) -> None:
    result = await client.call_tool("execute_code", {"check_only": True, "language": language, "code": code})
    assert not result.is_error, text_of(result)
    answer = json_of(result)
    assert answer["valid"] is False
    error = answer["errors"][0]
    assert error["line"] == line and error["column"] == column and error["message"]
    fine = await client.call_tool("execute_code", {"check_only": True, "language": language, "code": "x=1\n"})
    assert json_of(fine) == {"language": language, "valid": True, "errors": []}


async def test_validate_code_does_not_run_the_code(client: Client, dirs: ServerDirs) -> None:
    result = await client.call_tool(
        "execute_code",
        {"check_only": True, "language": "python", "code": "import os\nos.system('touch /workspace/ran')"},
    )
    assert json_of(result)["valid"] is True
    assert not list(dirs.workspaces.rglob("ran"))


async def test_install_packages_into_one_session_only(client: Client) -> None:
    created = await client.call_tool("create_session", {"network": "internet"})
    online = json_of(created)["session_id"]
    other = json_of(await client.call_tool("create_session", {"network": "internet"}))["session_id"]
    installed = await client.call_tool("install_packages", {"packages": ["six==1.17.0"], "session_id": online})
    assert not installed.is_error, text_of(installed)
    assert json_of(installed)["installed"] == {"six": "1.17.0"}
    assert "1.17.0" in text_of(await run(client, "import six; six.__version__", session_id=online))
    await client.call_tool("kernel_reset", {"session_id": online})
    assert "1.17.0" in text_of(await run(client, "import six; six.__version__", session_id=online))
    for elsewhere in (other, None):
        missing = (
            await run(client, "import six", session_id=elsewhere) if elsewhere else await run(client, "import six")
        )
        assert missing.is_error and "ModuleNotFoundError" in text_of(missing)
    one_shot = await execute(client, "python", "import six")
    assert "ModuleNotFoundError" in one_shot["stderr"]


async def test_install_packages_needs_network_and_plain_requirements(client: Client) -> None:
    await refused(client, "install_packages", {"packages": ["six"]}, "needs network", "network='internet'")
    for bad in ("--index-url=http://127.0.0.1/simple", "git+https://example.org/x.git", "../evil", "six; os"):
        await refused(client, "install_packages", {"packages": [bad]}, "not a requirement specifier")


async def test_get_capabilities(client: Client) -> None:
    result = await client.call_tool("get_capabilities", {})
    assert not result.is_error, text_of(result)
    caps = json_of(result)
    assert caps["languages"]["python"]["version"].startswith("3.")
    assert caps["languages"]["javascript"]["version"].startswith("v")
    assert "bash" in caps["languages"]["bash"]["version"]
    assert caps["sandbox"]["backend"] == "bwrap" and "seccomp" in caps["sandbox"]["isolation"]
    assert caps["limits"]["memory_mb"]["value"] == 2048 and caps["network"]["default"] == "none"
    allowlist = caps["network"]["allowlist"]
    assert caps["network"]["modes"]["allowlist"] == "available" and "allowed_domains" in allowlist["allowed_domains"]
    assert allowlist["enforcement"].startswith("enforced on bwrap:") and "github" in allowlist["presets"]
    assert {"numpy", "pandas", "matplotlib"} <= set(caps["packages"])
    assert {"run_python", "execute_code", "install_packages", "get_capabilities"} <= set(caps["tools"])
