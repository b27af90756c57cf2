"""A kernel's connection info (what jupyter's connection file says) and its channels' addresses."""

from __future__ import annotations

import secrets
import socket
from typing import Any


def connection_info(key: str, transport: str, ip: str) -> dict[str, Any]:
    """A kernel's connection info: ipc "ports" are only name suffixes; tcp ports are free ones."""
    ports = free_tcp_ports(5) if transport == "tcp" else secrets.SystemRandom().sample(range(1000, 61000), 5)
    names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
    return {
        **dict(zip(names, ports, strict=True)),
        "ip": ip,
        "key": key,
        "transport": transport,
        "signature_scheme": "hmac-sha256",
        "kernel_name": "python3",
    }


def free_tcp_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def channel_url(info: dict[str, Any], port: int) -> str:
    if info["transport"] == "ipc":
        return f"ipc://{info['ip']}-{port}"
    return f"tcp://{info['ip']}:{port}"


#: Looking for a starting kernel's ipc sockets: every SOCKETS_POLL_S for SOCKETS_POLL_QUICK_S (a start on
#: a quiet machine takes about 0.2 s), then every SOCKETS_POLL_SHARE of the time waited so far, up to
#: SOCKETS_POLL_MAX_S. A start slowed by a busy machine polled 200 times a second while it waited, and
#: so slowed every start further: 40 cluster sessions at once on 2 cores spent 0.27-0.37 CPU-s each
#: opening, 0.11-0.14 with the back-off (bench/actor_cpu.py).
SOCKETS_POLL_S = 0.005
SOCKETS_POLL_QUICK_S = 0.25
SOCKETS_POLL_SHARE = 0.05
SOCKETS_POLL_MAX_S = 0.05


def socket_poll_s(waited_s: float) -> float:
    """How long to wait before looking for a starting kernel's sockets again, `waited_s` into its start."""
    if waited_s < SOCKETS_POLL_QUICK_S:
        return SOCKETS_POLL_S
    return min(max(SOCKETS_POLL_S, waited_s * SOCKETS_POLL_SHARE), SOCKETS_POLL_MAX_S)
