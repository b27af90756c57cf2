"""Boundary tests: each tries to cross one line the sandbox promises, asserts it could not,
and asserts the server still serves a normal call afterwards."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from mcp import Client

from .conftest import REPO, SECRET_NAME, SECRET_VALUE, ServerDirs, run, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


async def probe(client: Client, code: str, **arguments: object) -> dict[str, object]:
    """Run `code` that ends by printing one JSON object; return it."""
    result = await run(client, code, **arguments)
    assert not result.is_error, text_of(result)
    # The printed JSON is the last line that parses; status lines ("[ok ...]", "[kernel N: ...]") follow it.
    for line in reversed(text_of(result).splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    raise AssertionError(f"no JSON line in: {text_of(result)}")


async def assert_still_serves(client: Client) -> None:
    result = await run(client, "sum(range(10))")
    assert not result.is_error and text_of(result).splitlines()[0] == "45"


READ_ATTEMPT = """
import json
def attempt(path):
    try:
        with open(path, 'rb') as handle:
            handle.read(64)
        return 'READ'
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({p: attempt(p) for p in PATHS}))
"""


async def test_host_files_are_not_readable(client: Client) -> None:
    """/etc/shadow, the repository, the server user's $HOME and the host's /etc/passwd stay outside."""
    home = Path(os.environ.get("HOME", "/root"))
    paths = ["/etc/shadow", str(REPO / "pyproject.toml"), str(home / ".bashrc"), str(home), "/root/.profile"]
    outcome = await probe(client, f"PATHS = {paths!r}\n{READ_ATTEMPT}")
    assert all(value != "READ" for value in outcome.values()), outcome
    listing = await probe(
        client,
        "import os, json\nprint(json.dumps({'root': sorted(os.listdir('/')), 'etc': sorted(os.listdir('/etc')),"
        " 'passwd': open('/etc/passwd').read()}))",
    )
    assert "home" not in listing["root"] and "root" not in listing["root"] and "work" not in listing["root"]
    assert "shadow" not in listing["etc"]
    assert "root:" not in listing["passwd"], "the host's passwd must not be shown"
    # Its own /etc files and its kernel's key are copied into its root, not bound: nothing in it may change them.
    changed = await probe(
        client,
        "import os, json, errno\nfound = {}\n"
        "for path in ('/etc/passwd', '/etc/hosts', '/etc/resolv.conf', '/run/kernel/connection.json'):\n"
        "    for what, act in (('write', lambda: open(path, 'a').close()), ('chmod', lambda: os.chmod(path, 0o666)),\n"
        "            ('rename', lambda: os.rename(path, path + '.x')), ('unlink', lambda: os.unlink(path))):\n"
        "        try:\n            act(); found[path + ' ' + what] = 'done'\n"
        "        except OSError as exc:\n            found[path + ' ' + what] = errno.errorcode[exc.errno]\n"
        "print(json.dumps(found))",
    )
    assert set(changed.values()) <= {"EROFS", "EACCES"}, changed
    await assert_still_serves(client)


async def test_secret_environment_never_enters_the_sandbox(client: Client) -> None:
    outcome = await probe(
        client,
        "import os, glob, json\n"
        "found = [k for k, v in os.environ.items() if 'sk-test-' in v]\n"
        "leaks = []\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        f"        if b'sk-test-' in open(path, 'rb').read() or b'{SECRET_NAME}' in open(path, 'rb').read():\n"
        "            leaks.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(json.dumps({'env': found, 'proc': leaks, 'keys': sorted(os.environ)}))",
    )
    assert outcome["env"] == [] and outcome["proc"] == []
    assert SECRET_NAME not in outcome["keys"]
    assert not any(key.startswith("CODERUNNER_") for key in outcome["keys"])  # type: ignore[union-attr]
    assert SECRET_VALUE not in json.dumps(outcome)
    await assert_still_serves(client)


async def test_no_network_egress(client: Client) -> None:
    """TCP to the internet, UDP/DNS, and the host's loopback services (the MCP server's own port)."""
    outcome = await probe(
        client,
        "import socket, json\n"
        "def tcp(host, port):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=3).close()\n"
        "        return 'CONNECTED'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        "def dns(name):\n"
        "    try:\n"
        "        return socket.gethostbyname(name)\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        "def udp():\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    try:\n"
        "        s.sendto(b'x', ('8.8.8.8', 53))\n"
        "        return 'SENT'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        "ifaces = [name for _, name in socket.if_nameindex()]\n"
        "print(json.dumps({'tcp': tcp('1.1.1.1', 443), 'dns': dns('pypi.org'), 'udp': udp(),\n"
        "                  'loopback_ssh': tcp('127.0.0.1', 22), 'ifaces': ifaces}))",
    )
    assert outcome["tcp"] != "CONNECTED"
    assert outcome["udp"] != "SENT"
    assert outcome["loopback_ssh"] != "CONNECTED"
    assert outcome["ifaces"] == ["lo"], "only the sandbox's own loopback exists"
    assert not str(outcome["dns"])[0].isdigit(), outcome["dns"]
    await assert_still_serves(client)


async def test_sandbox_cannot_reach_the_servers_own_http_port(dirs: ServerDirs) -> None:
    """The HTTP server listens on the host's 127.0.0.1; the sandbox's loopback is its own."""
    from .conftest import connect_http, http_server, server_env

    with http_server(server_env(dirs)) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        async with connect_http(url) as client:
            outcome = await probe(
                client,
                "import socket, json\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=3).close(); r = 'CONNECTED'\n"
                "except OSError as exc:\n    r = type(exc).__name__\nprint(json.dumps({'r': r}))",
            )
            assert outcome["r"] != "CONNECTED"
            await assert_still_serves(client)


async def test_writes_outside_the_workspace_fail(client: Client, dirs: ServerDirs) -> None:
    outcome = await probe(
        client,
        "import json\n"
        "def attempt(path):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        return 'WROTE'\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        "print(json.dumps({p: attempt(p) for p in ['/usr/evil', '/etc/evil', '/opt/coderunner/env/evil',"
        " '/evil', '/workspace/../evil']}))",
    )
    assert all(value != "WROTE" for value in outcome.values()), outcome
    assert not any(Path(p).exists() for p in ["/usr/evil", "/etc/evil", "/evil"])
    await assert_still_serves(client)


async def test_not_root_and_no_capabilities_inside(client: Client) -> None:
    outcome = await probe(
        client,
        "import os, json\n"
        "status = open('/proc/self/status').read()\n"
        "caps = {l.split(':')[0]: l.split()[1] for l in status.splitlines() if l.startswith('Cap')}\n"
        "print(json.dumps({'uid': os.getuid(), 'euid': os.geteuid(), 'caps': caps,"
        " 'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}))",
    )
    assert outcome["uid"] == 1000 and outcome["euid"] == 1000
    caps = outcome["caps"]
    assert isinstance(caps, dict)
    assert caps["CapEff"] == "0000000000000000" and caps["CapPrm"] == "0000000000000000"
    assert max(outcome["pids"]) < 100, "only the sandbox's own processes are visible"  # type: ignore[arg-type]
    await assert_still_serves(client)


async def test_two_sessions_see_neither_variables_nor_files(client: Client, dirs: ServerDirs) -> None:
    created = await client.call_tool("create_session", {})
    assert not created.is_error, text_of(created)
    other = json.loads(text_of(created))["session_id"]
    await run(client, "shared_name = 'from default'\nopen('mine.txt', 'w').write('default secret')")
    result = await run(client, "shared_name", session_id=other)
    assert result.is_error and "NameError" in text_of(result)
    result = await run(client, "import os\nsorted(os.listdir('.'))", session_id=other)
    assert "mine.txt" not in text_of(result)
    # The other session's workspace, by its host path, does not exist inside this sandbox.
    host_workspaces = [str(path) for path in dirs.session_workspaces() if path.is_dir()]
    assert len(host_workspaces) == 2
    outcome = await probe(client, f"PATHS = {[p + '/mine.txt' for p in host_workspaces]!r}\n{READ_ATTEMPT}",
                          session_id=other)  # fmt: skip
    assert all(value != "READ" for value in outcome.values()), outcome
    # Nor the other session's kernel sockets: of the two runtime dirs, only its own exists inside.
    runtime_dirs = [str(path / "run") for path in dirs.session_runtime_dirs()]
    assert len(runtime_dirs) == 2
    visible = await probe(
        client,
        f"import os, json\nprint(json.dumps([os.path.exists(p) for p in {runtime_dirs!r}]))",
        session_id=other,
    )
    assert sorted(visible) == [False, True], visible  # type: ignore[type-var]
    await assert_still_serves(client)
