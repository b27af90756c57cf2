"""The egress audit log under a denial flood: one sandbox must not rotate away everyone's history.

One allowlist server with a small-ish ceiling. A bystander session makes an allowed and a denied
request first (its audit records are the canary), then another session's sandbox sends denied
CONNECTs to its proxy as fast as it can for a bounded number of tries and time. Afterwards: the
bystander's records are still in the file, the flooder wrote no more lines than the rate limit
allows and no more bytes than its share, the folded counts add up to exactly the denials the
flooder was answered, the files stay within their bound, the server serves and the bystander kept
its state and its network.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from mcp import Client

from coderunner.egress.audit import MAX_FOLDED_HOSTS, SESSION_BURST, SESSION_SHARE, WINDOW_S, MiB

from ..conftest import ServerDirs, fresh_dirs, server_env, stdio_client, text_of, wait_until
from ..netns_servers import BODY, NetnsServers
from .conftest import BYSTANDER_VALUE
from .test_abuse_egress import create, ok

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: The audit file as the server makes it (sessions/egress_wiring.py): 8 MiB, the live file and 3 rotated.
MAX_BYTES, FILES = 8 * MiB, 4
SESSION_BYTES = FILES * MAX_BYTES // SESSION_SHARE
FLOOD_TRIES, FLOOD_S = 3000, 90


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Arena:
    client: Client
    servers: NetnsServers
    dirs: ServerDirs
    bystander: str


@pytest.fixture(scope="module")
async def arena(servers: NetnsServers) -> AsyncIterator[Arena]:
    with fresh_dirs("crq-") as dirs:
        env = server_env(
            dirs,
            CODERUNNER_ALLOWED_DOMAINS=json.dumps([servers.public_ip]),
            CODERUNNER_EGRESS_AUDIT_LOG=str(dirs.root / "audit" / "egress.jsonl"),
            CODERUNNER_TIMEOUT_S="120",
        )
        async with stdio_client(env) as client:
            bystander = await create(client, network="allowlist")
            await ok(client, f"guarded = {BYSTANDER_VALUE!r}", bystander)
            yield Arena(client, servers, dirs, bystander)


def get_code(url: str) -> str:
    return f"""
import urllib.request, urllib.error
try:
    print(urllib.request.urlopen({url!r}, timeout=20).read().decode())
except Exception as exc:
    print('failed', exc)
"""


def audit_lines(dirs: ServerDirs) -> list[dict[str, Any]]:
    """Every line of the live file and the rotated ones, oldest first."""
    folder = dirs.root / "audit"
    names = ["egress.jsonl"] + [f"egress.jsonl.{k}" for k in range(1, FILES)]
    found = []
    for name in reversed(names):
        path = folder / name
        if path.exists():
            found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return found


# Denied CONNECTs straight at the proxy, four threads, bounded in tries and time: many distinct
# hosts (each worth a folded line) and one host over and over.
FLOOD = f"""
import socket, threading, time, json
deadline = time.monotonic() + {FLOOD_S}
tries = {FLOOD_TRIES}
lock = threading.Lock()
answered = {{'403': 0, 'other': 0, 'errors': 0}}
def flood(k):
    global tries
    i = 0
    while time.monotonic() < deadline:
        with lock:
            if tries == 0:
                return
            tries -= 1
        i += 1
        host = f'h{{i % 60}}.flood.invalid' if k % 2 else 'same.flood.invalid'
        try:
            with socket.create_connection(('127.0.0.1', 3128), timeout=20) as s:
                s.sendall(f'CONNECT {{host}}:443 HTTP/1.1\\r\\nHost: {{host}}:443\\r\\n\\r\\n'.encode())
                line = s.recv(4096).decode('latin-1').split('\\r\\n')[0]
            with lock:
                answered['403' if line.startswith('HTTP/1.1 403') else 'other'] += 1
        except OSError:
            with lock:
                answered['errors'] += 1
threads = [threading.Thread(target=flood, args=(k,)) for k in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(answered))
"""


async def test_a_denial_flood_cannot_rotate_away_a_bystanders_audit_records(arena: Arena) -> None:
    url = f"http://{arena.servers.public_ip}/"
    assert BODY in await ok(arena.client, get_code(url), arena.bystander)
    assert "failed" in await ok(arena.client, get_code("http://canary-denied.invalid/"), arena.bystander)

    def bystander_records() -> list[tuple[str, bool]]:
        return [(g["host"], g["allowed"]) for g in audit_lines(arena.dirs) if g.get("session") == arena.bystander]

    expected = [(arena.servers.public_ip, True), ("canary-denied.invalid", False)]
    assert await wait_until(lambda: bystander_records() == expected), bystander_records()

    flooder = await create(arena.client, network="allowlist")
    started = time.monotonic()
    text = await ok(arena.client, FLOOD, flooder)
    elapsed = time.monotonic() - started
    answered = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    assert answered["403"] >= 500, answered  # a flood worth the name reached the proxy
    closed = await arena.client.call_tool("manage_sessions", {"action": "close", "session_id": flooder})
    assert not closed.is_error, text_of(closed)

    def flooded() -> list[dict[str, Any]]:
        return [g for g in audit_lines(arena.dirs) if g.get("session") == flooder]

    def denials() -> int:
        return sum(g.get("folded", 1) for g in flooded() if g["allowed"] is False)

    tried = answered["403"] + answered["other"] + answered["errors"]
    assert await wait_until(lambda: denials() >= answered["403"]), (denials(), answered)
    if answered["other"] == answered["errors"] == 0:
        assert denials() == answered["403"]  # nothing lost as a count
    assert denials() <= tried

    # The bystander's earlier records are still there; the flood kept to its rate and its share.
    assert bystander_records()[:2] == expected
    windows = int(elapsed // WINDOW_S) + 2
    assert len(flooded()) <= windows * (SESSION_BURST + MAX_FOLDED_HOSTS + 1) + 1, (len(flooded()), answered)
    share = sum(len(json.dumps(g, separators=(",", ":"))) + 1 for g in flooded())
    assert share <= SESSION_BYTES + 1024
    sizes = [p.stat().st_size for p in (arena.dirs.root / "audit").iterdir() if p.name.startswith("egress.jsonl")]
    assert len(sizes) <= FILES and all(size <= MAX_BYTES for size in sizes), sizes

    # The server serves, and the bystander kept its state and its network.
    reply = await ok(arena.client, f"print(guarded)\n{get_code(url)}", arena.bystander)
    assert BYSTANDER_VALUE in reply and BODY in reply, reply
