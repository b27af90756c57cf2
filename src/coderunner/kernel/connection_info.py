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
