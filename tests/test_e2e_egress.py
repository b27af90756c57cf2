"""Network 'allowlist' for real: sessions and one-shot runs reach only what the user allowed.

One server per module, with a ceiling of the package index preset, a test server in a network
namespace of the test's own (TEST-NET-2, reached by IP literal), `localhost` and a private
10.x server (both allowlisted, both to be refused by address). Containment cases (other sessions,
host loopback, floods) are in tests/abuse/test_abuse_egress.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from mcp import Client

from .conftest import ServerDirs, _passable, run, server_env, stdio_client, text_of, wait_until
from .netns_servers import BODY, NetnsServers

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]
from .test_e2e_podman import podman_image  # noqa: E402, F401 - a fixture, built only when asked for

BLOCKED = "blocked by CodeRunner's network policy"
DENIED_HOST = "denied.example.org"
PROXY = "http://127.0.0.1:3128"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Egress:
    client: Client
    servers: NetnsServers
    #: An allowlist session with the whole ceiling.
    session: str
    dirs: ServerDirs


@pytest.fixture(scope="module")
def module_dirs() -> Iterator[ServerDirs]:
    root = _passable(Path(tempfile.mkdtemp(prefix="cre-", dir="/tmp")))
    yield ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    shutil.rmtree(root, ignore_errors=True)


def egress_env(dirs: ServerDirs, servers: NetnsServers, **extra: str) -> dict[str, str]:
    ceiling = ["python-packages", servers.public_ip, servers.private_ip, "localhost"]
    return server_env(
        dirs,
        CODERUNNER_ALLOWED_DOMAINS=json.dumps(ceiling),
        CODERUNNER_EGRESS_AUDIT_LOG=str(dirs.root / "egress.jsonl"),
        CODERUNNER_TIMEOUT_S="40",
        **extra,
    )


@pytest.fixture(scope="module")
async def egress(module_dirs: ServerDirs, servers: NetnsServers) -> AsyncIterator[Egress]:
    async with stdio_client(egress_env(module_dirs, servers)) as client:
        session = await create(client, network="allowlist")
        yield Egress(client, servers, session, module_dirs)


async def create(client: Client, **arguments: object) -> str:
    created = await client.call_tool("create_session", arguments)
    assert not created.is_error, text_of(created)
    return json.loads(text_of(created))["session_id"]


async def ok(client: Client, code: str, session_id: str) -> str:
    result = await run(client, code, session_id=session_id)
    assert not result.is_error, text_of(result)
    return text_of(result)


async def execute(client: Client, language: str, code: str, **arguments: object) -> dict:  # type: ignore[type-arg]
    result = await client.call_tool("execute_code", {"language": language, "code": code, **arguments})
    return json.loads(text_of(result))


def fetch(url: str) -> str:
    """Python that prints the status and body of a GET with urllib (through the env's proxy)."""
    return f"""
import urllib.request, urllib.error
try:
    answer = urllib.request.urlopen({url!r}, timeout=20)
    print(answer.status, answer.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read().decode())
"""


def fetch_via_proxy(url: str) -> str:
    """Python that asks the proxy itself for `url`, past NO_PROXY (as code with its own proxy would)."""
    return f"""
import http.client
proxy = http.client.HTTPConnection('127.0.0.1', 3128, timeout=20)
proxy.request('GET', {url!r})
answer = proxy.getresponse()
print(answer.status, answer.read().decode())
"""


# --- what the allowlist lets through ---------------------------------------------------------------


async def test_an_allowlisted_server_is_reached_through_the_proxy(egress: Egress) -> None:
    text = await ok(egress.client, fetch(f"http://{egress.servers.public_ip}/"), egress.session)
    assert f"200 {BODY}" in text


async def test_the_sandbox_sees_the_proxy_in_its_environment(egress: Egress) -> None:
    code = "import os; print({k: os.environ.get(k) for k in ('HTTP_PROXY', 'https_proxy', 'NO_PROXY')})"
    text = await ok(egress.client, code, egress.session)
    assert f"'HTTP_PROXY': '{PROXY}'" in text and f"'https_proxy': '{PROXY}'" in text
    assert "'NO_PROXY': 'localhost,127.0.0.1,::1'" in text


async def test_install_packages_works_with_the_package_preset(egress: Egress) -> None:
    result = await egress.client.call_tool(
        "install_packages", {"packages": ["six==1.17.0"], "session_id": egress.session}
    )
    assert not result.is_error, text_of(result)
    assert json.loads(text_of(result))["installed"] == {"six": "1.17.0"}
    assert "1.17.0" in await ok(egress.client, "import six; print(six.__version__)", egress.session)


async def test_one_shot_runs_of_every_language_reach_the_allowlisted_server(egress: Egress) -> None:
    url = f"http://{egress.servers.public_ip}/"
    python = await execute(egress.client, "python", fetch(url), network="allowlist")
    assert f"200 {BODY}" in python["stdout"], python
    bash = await execute(egress.client, "bash", f"curl -sS {url}", network="allowlist")
    assert bash["stdout"] == BODY, bash
    node = await execute(egress.client, "javascript", f"fetch({url!r}).then(r => r.text()).then(console.log)",
                         network="allowlist")  # fmt: skip
    assert node["stdout"].strip() == BODY, node


async def oneshot_counts(client: Client) -> dict[str, int]:
    """What the server says of its one-shot sandboxes started ahead (get_capabilities)."""
    caps = json.loads(text_of(await client.call_tool("get_capabilities", {})))
    return dict(caps["sandbox"]["oneshot_ready"])


async def test_an_allowlist_run_takes_a_sandbox_started_ahead_served_with_the_run_s_policy(egress: Egress) -> None:
    """An allowlist one-shot run leaves a sandbox started for the next with the same options, its proxy's socket
    made with it and served only once a run takes it, with that run's policy: what is allowed is reached, what
    is not is denied and named in the reply; a run of other options starts its own."""
    public = f"http://{egress.servers.public_ip}/"
    first = await execute(egress.client, "python", fetch(public), network="allowlist")
    assert f"200 {BODY}" in first["stdout"], first
    for _ in range(200):
        before = await oneshot_counts(egress.client)
        if before["ready"] >= 1:
            break
        await anyio.sleep(0.1)
    else:
        raise AssertionError(f"no allowlist sandbox was started ahead: {before}")
    code = fetch(public) + fetch(f"http://{DENIED_HOST}/")
    result = await egress.client.call_tool("execute_code", {"language": "python", "code": code, "network": "allowlist"})
    again = json.loads(text_of(result))
    assert f"200 {BODY}" in again["stdout"] and "403" in again["stdout"], again
    assert DENIED_HOST in json.dumps([block.model_dump() for block in result.content]), result.content
    taken = await oneshot_counts(egress.client)
    assert taken["runs_taken"] == before["runs_taken"] + 1, (before, taken)
    offline = await execute(egress.client, "python", "print(1)")
    assert offline["stdout"] == "1\n" and (await oneshot_counts(egress.client))["runs_cold"] == taken["runs_cold"] + 1


async def test_a_reset_swaps_to_a_standby_behind_the_same_allowlist(egress: Egress) -> None:
    """The session's standby kernel (sessions/standby.py) reaches what the session may, and nothing more."""
    session = await create(egress.client, network="allowlist", allow=[egress.servers.public_ip])
    with anyio.fail_after(60):
        while (await status(egress.client, session))["standby"]["state"] != "ready":
            await anyio.sleep(0.1)
    reset = await egress.client.call_tool("kernel_reset", {"session_id": session})
    assert not reset.is_error, text_of(reset)
    assert (await status(egress.client, session))["standby"]["swapped_in"] == 1
    assert f"200 {BODY}" in await ok(egress.client, fetch(f"http://{egress.servers.public_ip}/"), session)
    denied = await ok(egress.client, fetch(f"http://{DENIED_HOST}/"), session)
    assert denied.startswith("403 ") and BLOCKED in denied, denied
    await egress.client.call_tool("manage_sessions", {"action": "close", "session_id": session})


async def status(client: Client, session: str) -> dict:  # type: ignore[type-arg]
    result = await client.call_tool("manage_sessions", {"action": "status", "session_id": session})
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


# --- what it refuses -------------------------------------------------------------------------------


async def test_a_host_off_the_list_is_denied_with_the_message_from_python(egress: Egress) -> None:
    text = await ok(egress.client, fetch(f"http://{DENIED_HOST}/"), egress.session)
    assert text.startswith("403 ") and BLOCKED in text and DENIED_HOST in text, text
    tls = await run(egress.client, fetch(f"https://{DENIED_HOST}/"), session_id=egress.session)
    # A refused tunnel: Python shows the status line, whose reason phrase carries the policy's words.
    assert f"Tunnel connection failed: 403 Forbidden ({BLOCKED}" in text_of(tls), text_of(tls)


async def test_a_host_off_the_list_is_denied_with_the_message_from_requests(egress: Egress) -> None:
    # requests is not in the sandbox's environment: installed through the allowlist first.
    installed = await egress.client.call_tool(
        "install_packages", {"packages": ["requests"], "session_id": egress.session}
    )
    assert not installed.is_error, text_of(installed)
    code = f"""
import requests
print(requests.get('http://{DENIED_HOST}/', timeout=20).text)
try:
    requests.get('https://{DENIED_HOST}/', timeout=20)
except requests.exceptions.ProxyError as exc:
    print('TLS', exc)
"""
    text = await ok(egress.client, code, egress.session)
    assert text.startswith(BLOCKED) and DENIED_HOST in text, text
    assert f"Tunnel connection failed: 403 Forbidden ({BLOCKED}" in text, text


async def test_a_host_off_the_list_is_denied_with_the_message_from_curl_and_node(egress: Egress) -> None:
    curl = await execute(egress.client, "bash", f"curl -sS http://{DENIED_HOST}/", network="allowlist")
    assert BLOCKED in curl["stdout"], curl
    tunnel = await execute(egress.client, "bash", f"curl -sS https://{DENIED_HOST}/ 2>&1", network="allowlist")
    assert "403" in tunnel["stdout"], tunnel
    node = await execute(
        egress.client,
        "javascript",
        f"fetch('http://{DENIED_HOST}/').then(r => console.log('FETCHED', r.status), e => console.log(e.message))",
        network="allowlist",
    )
    assert BLOCKED in node["stdout"] and DENIED_HOST in node["stdout"] and "FETCHED" not in node["stdout"], node


async def test_browser_navigate_is_denied_with_the_message(egress: Egress) -> None:
    result = await egress.client.call_tool(
        "browser_navigate", {"url": f"http://{DENIED_HOST}/", "session_id": egress.session}
    )
    text = text_of(result)
    assert BLOCKED in text, text
    allowed = await egress.client.call_tool(
        "browser_navigate",
        {"url": f"http://{egress.servers.public_ip}/", "session_id": egress.session},
    )
    assert BODY in text_of(allowed), text_of(allowed)


async def test_a_raw_socket_to_an_ip_fails(egress: Egress) -> None:
    code = f"""
import socket
for target in [({egress.servers.public_ip!r}, 80), ('1.1.1.1', 443)]:
    try:
        socket.create_connection(target, timeout=5)
        print('CONNECTED', target)
    except OSError as exc:
        print('refused', exc.errno)
"""
    text = await ok(egress.client, code, egress.session)
    assert "CONNECTED" not in text and text.count("refused") == 2, text


async def test_localhost_and_a_private_address_are_refused_even_when_allowlisted(egress: Egress) -> None:
    for host in ("localhost", egress.servers.private_ip):
        text = await ok(egress.client, fetch_via_proxy(f"http://{host}/"), egress.session)
        assert text.startswith("403 ") and BODY not in text, (host, text)


async def test_a_session_may_ask_for_a_subset_but_never_more(egress: Egress) -> None:
    narrow = await create(egress.client, network="allowlist", allow=["python-packages"])
    text = await ok(egress.client, fetch(f"http://{egress.servers.public_ip}/"), narrow)
    assert text.startswith("403 ") and BLOCKED in text, text
    wider = await egress.client.call_tool("create_session", {"network": "allowlist", "allow": ["example.com"]})
    assert wider.is_error and "allowed_domains" in text_of(wider), text_of(wider)
    await egress.client.call_tool("manage_sessions", {"action": "close", "session_id": narrow})


async def test_install_packages_without_network_names_the_way_out_within_the_ceiling(egress: Egress) -> None:
    plain = await create(egress.client)
    result = await egress.client.call_tool("install_packages", {"packages": ["six"], "session_id": plain})
    assert result.is_error
    # The user allowed domains, not the internet: the hint names the allowlist only.
    assert "network='allowlist'" in text_of(result) and "internet" not in text_of(result), text_of(result)
    await egress.client.call_tool("manage_sessions", {"action": "close", "session_id": plain})


def audit_lines(dirs: ServerDirs) -> list[dict]:  # type: ignore[type-arg]
    log = dirs.root / "egress.jsonl"
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_decisions_reach_the_audit_log(egress: Egress) -> None:
    await ok(egress.client, fetch(f"http://{DENIED_HOST}/"), egress.session)
    # Written by a worker thread, within a bound.
    denied = lambda: any(line.get("host") == DENIED_HOST and line.get("allowed") is False  # noqa: E731
                         for line in audit_lines(egress.dirs))  # fmt: skip
    assert await wait_until(denied), audit_lines(egress.dirs)[-5:]


# --- the same core cases on podman -----------------------------------------------------------------


@pytest.fixture(scope="module")
def podman_image_name(request: pytest.FixtureRequest) -> str:
    """CODERUNNER_IMAGE when the caller built one of its own, else test_e2e_podman's build."""
    return os.environ.get("CODERUNNER_IMAGE") or request.getfixturevalue("podman_image")


@pytest.fixture(scope="module")
async def podman_egress(podman_image_name: str, servers: NetnsServers) -> AsyncIterator[Egress]:
    root = _passable(Path(tempfile.mkdtemp(prefix="crp-", dir="/tmp")))
    dirs = ServerDirs(root=root, runtime=root / "r", workspaces=root / "w")
    env = egress_env(dirs, servers, CODERUNNER_BACKEND="podman", CODERUNNER_OCI_RUNTIME="runc",
                     CODERUNNER_IMAGE=podman_image_name)  # fmt: skip
    try:
        async with stdio_client(env) as client:
            yield Egress(client, servers, await create(client, network="allowlist"), dirs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_podman_allowlist_reaches_only_what_is_allowed(podman_egress: Egress) -> None:
    client, session, servers = podman_egress.client, podman_egress.session, podman_egress.servers
    assert f"200 {BODY}" in await ok(client, fetch(f"http://{servers.public_ip}/"), session)
    denied = await ok(client, fetch(f"http://{DENIED_HOST}/"), session)
    assert denied.startswith("403 ") and BLOCKED in denied, denied
    for host in ("localhost", servers.private_ip):
        refused = await ok(client, fetch_via_proxy(f"http://{host}/"), session)
        assert refused.startswith("403 ") and BODY not in refused, (host, refused)
    raw = f"""
import socket
try:
    socket.create_connection(({servers.public_ip!r}, 80), timeout=5); print('CONNECTED')
except OSError as exc:
    print('refused', exc.errno)
"""
    assert "refused" in await ok(client, raw, session)
    # One-shot runs too (the image has no curl: Python).
    once = await execute(client, "python", fetch(f"http://{servers.public_ip}/"), network="allowlist")
    assert f"200 {BODY}" in once["stdout"], once
    # Node 18 in the image, with Debian's node-undici: fetch follows the proxy and explains a refusal.
    node = await execute(
        client,
        "javascript",
        f"fetch('http://{servers.public_ip}/').then(r => r.text()).then(console.log);"
        f"fetch('http://{DENIED_HOST}/').then(r => console.log('FETCHED', r.status), e => console.log(e.message))",
        network="allowlist",
    )
    assert BODY in node["stdout"] and BLOCKED in node["stdout"] and "FETCHED" not in node["stdout"], node
    # runc shares the host's kernel: the client socket crosses to the host, and a bad fd does not.
    results = handoff_results(await ok(client, HANDOFF_PROBE.replace("{ip}", servers.public_ip), session))
    assert results["a connected socket"] == "01" and results["its answer"] == "HTTP/1.0 200 OK", results
    assert results["a listening socket"] == "" and results["no fd"] == "02", results


# --- the handoff of client sockets to the host (egress/handoff.py), attacked from inside ----------

HANDOFF_PROBE = """
import array, json, os, socket
# The forwarder's argv names the proxy's socket (its host-only dir is bound in read-only).
path = next(arg.decode() for pid in filter(str.isdigit, os.listdir('/proc'))
            for arg in open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0') if arg.endswith(b'/egress.sock'))

def hand(fds, first=b'\\x00'):
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(20)
        conn.connect(path)
        conn.sendmsg([first], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds))] if fds else [])
        try:
            return conn.recv(1).hex()
        except OSError:
            return 'reset'

read_end, write_end = os.pipe()
a_file = open('/tmp/handoff-probe', 'w+')
unix_a, unix_b = socket.socketpair()
listening = socket.create_server(('127.0.0.1', 0))
results = {
    'a file': hand([a_file.fileno()]),
    'a pipe': hand([read_end]),
    'a unix socket': hand([unix_a.fileno()]),
    'a listening socket': hand([listening.fileno()]),
    'many fds': hand([listening.fileno()] * 100),
    'no fd': hand([]),
    'flood': sorted(set(hand([read_end, write_end]) for _ in range(300))),
}
client = socket.create_connection(listening.getsockname(), timeout=20)
accepted, _ = listening.accept()
results['a connected socket'] = hand([accepted.fileno()])
accepted.close()
client.sendall(b'GET http://{ip}/ HTTP/1.1\\r\\nHost: {ip}\\r\\n\\r\\n')
answer = b''
while chunk := client.recv(65536):
    answer += chunk
results['its answer'] = answer.split(b'\\r\\n', 1)[0].decode()
print(json.dumps(results))
"""


def handoff_results(text: str) -> dict:  # type: ignore[type-arg]
    return next(json.loads(line) for line in text.splitlines() if line.startswith('{"'))


async def test_handoffs_of_anything_but_a_connected_socket_are_refused_and_egress_goes_on(egress: Egress) -> None:
    """Code in the sandbox speaks the handoff itself: every bad fd is refused (the host closes the
    connection), the byte alone gets NO_FD, its own connected socket is taken and served, and its
    session and a bystander's still reach the allowed server through their forwarders."""
    attacker = await create(egress.client, network="allowlist")
    ip = egress.servers.public_ip
    text = await ok(egress.client, HANDOFF_PROBE.replace("{ip}", ip), attacker)
    results = handoff_results(text)
    refused = ["a file", "a pipe", "a unix socket", "a listening socket", "many fds"]
    assert {kind: results[kind] for kind in refused} == dict.fromkeys(refused, ""), results
    assert results["no fd"] == "02" and results["flood"] == [""], results
    assert results["a connected socket"] == "01" and results["its answer"] == "HTTP/1.0 200 OK", results
    assert f"200 {BODY}" in await ok(egress.client, fetch(f"http://{ip}/"), attacker)
    assert f"200 {BODY}" in await ok(egress.client, fetch(f"http://{ip}/"), egress.session)
    await egress.client.call_tool("manage_sessions", {"action": "close", "session_id": attacker})
