"""Whether this sandbox's network reaches the package index, asked of its proxy before pip runs.

In network 'allowlist' every connection goes through the session's policy proxy. pip retries a
refused one for seconds, then says only that no version was found. A CONNECT to each host pip will
fetch from answers at once: 200 (allowed; the proxy may first put the host to the user), or the
proxy's own refusal text, which names the host and the way to reach it. Elsewhere (network
'internet') there is no proxy to ask and pip's own errors stand.
"""

import os
import re
import socket
import time
from urllib.parse import urlsplit

from .dispatch import read_only_imports

#: Set by the host in a sandbox with network 'allowlist': its policy proxy (sandbox/common.py).
PROXY_ENV = "CODERUNNER_EGRESS_PROXY"
#: Bound on one probe: the proxy may put the host to the user first (up to a minute to queue, a minute
#: to answer: egress/policy_proxy.py ASK_TIMEOUT_S).
PROBE_TIMEOUT_S = 130.0
CONNECT_TIMEOUT_S = 10.0
#: Bounds on what a probe reads of the proxy's answer.
PROBE_HEAD_BYTES = 16384
PROBE_BODY_BYTES = 4096


def index_hosts():
    """The hosts pip fetches from: PIP_INDEX_URL's, else pip's default index and file hosts."""
    configured = os.environ.get("PIP_INDEX_URL")
    if configured:
        parts = urlsplit(configured)
        if parts.hostname:
            return [(parts.hostname, parts.port or (80 if parts.scheme == "http" else 443))]
        return []
    try:
        with read_only_imports():  # pip of the environment, never a pip/ planted in the workspace
            from pip._internal.models.index import PyPI
    except ImportError:
        return []
    return [(str(PyPI.netloc), 443), (str(PyPI.file_storage_domain), 443)]


def _read_answer(sock, deadline):
    """The status code and body text of the proxy's answer to a CONNECT (bounded)."""
    data = b""
    while b"\r\n\r\n" not in data:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = sock.recv(4096)
        if not chunk or len(data) > PROBE_HEAD_BYTES:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split(b" ", 2)
    code = int(status[1]) if len(status) > 1 and status[1].isdigit() else 0
    if code == 200:
        return code, ""
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    wanted = min(int(length.group(1)) if length else PROBE_BODY_BYTES, PROBE_BODY_BYTES)
    while len(body) < wanted and time.monotonic() < deadline:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = sock.recv(wanted - len(body))
        if not chunk:
            break
        body += chunk
    text = body[:wanted].decode("utf-8", "replace").strip()
    return code, text or head.split(b"\r\n", 1)[0].decode("ascii", "replace")


def proxy_refusal(proxy, host, port):
    """What the session's proxy says to a CONNECT to host:port, or None when it lets it through."""
    parts = urlsplit(proxy)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode("ascii"))
            code, text = _read_answer(sock, deadline)
    except OSError as exc:
        return f"the session's network proxy did not answer ({exc})"
    return None if code == 200 else text


def unreachable():
    """Why pip cannot reach the package index from here (the proxy's words), or None."""
    proxy = os.environ.get(PROXY_ENV)
    if not proxy:
        return None
    for host, port in index_hosts():
        said = proxy_refusal(proxy, host, port)
        if said is not None:
            return f"pip cannot reach the package index ({host}) from this session: {said}"
    return None
