"""Ordinary clients through the proxy (via a TCP front, as the in-sandbox forwarder gives them one):
they get through to an allowed host with the real resolver and address check, and show the denial."""

from __future__ import annotations

import asyncio
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest

from coderunner.egress import EgressPolicy

from .harness import Upstream, loopback_only, resolver_for, running_proxy, tcp_front

pytestmark = pytest.mark.anyio

BLOCKED = "blocked by CodeRunner's network policy: evil.test is not in this session's allowlist"


def index_host() -> str:
    from pip._internal.models.index import PyPI

    return str(PyPI.netloc)


async def run(*argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_reaches_the_package_index_with_the_real_checks_and_shows_denials() -> None:
    """The package index on this machine resolves into a documentation range: it must pass."""
    policy = EgressPolicy.parse(["python-packages", "localhost"])
    async with running_proxy(policy) as proxied, tcp_front(proxied.path) as port:
        proxy = f"http://127.0.0.1:{port}"
        code, out, err = await run(
            "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-x", proxy, f"https://{index_host()}/simple/"
        )
        assert (code, out) == (0, "200"), err
        code, out, _ = await run("curl", "-sS", "-x", proxy, "http://evil.test/")
        assert code == 0 and out.startswith(BLOCKED)
        code, _, err = await run("curl", "-sS", "-x", proxy, "https://evil.test/")
        assert code != 0 and "403" in err
        code, out, _ = await run("curl", "-sS", "-x", proxy, "http://localhost/")
        assert "resolves to a private/loopback address" in out
        (allowed,) = [d for d in proxied.log.recent(10) if d.allowed]
        assert allowed.host == index_host() and allowed.received > 1000


async def test_urllib_shows_the_denial_and_gets_through_when_allowed() -> None:
    upstream = await Upstream().start()
    policy = EgressPolicy.parse(["ok.test"], ports=[upstream.port, 80, 443])
    resolver = resolver_for({"ok.test": ["127.0.0.1"]})
    try:
        async with (
            running_proxy(policy, resolver=resolver, address_check=loopback_only) as proxied,
            tcp_front(proxied.path) as port,
        ):
            opener = urllib.request.build_opener(
                urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{port}", "https": f"http://127.0.0.1:{port}"})
            )

            def fetch(url: str) -> str:
                try:
                    with opener.open(url, timeout=30) as response:
                        return f"{response.status} {response.read().decode()}"
                except urllib.error.HTTPError as exc:
                    return f"{exc.code} {exc.read().decode()}"
                except urllib.error.URLError as exc:
                    return f"URLError {exc.reason}"

            ok = await asyncio.to_thread(fetch, f"http://ok.test:{upstream.port}/hello")
            assert ok.startswith("200 GET /hello HTTP/1.1\r\nHost: ok.test:")
            denied = await asyncio.to_thread(fetch, "http://evil.test/")
            assert denied.startswith("403 " + BLOCKED)
            tunnel = await asyncio.to_thread(fetch, "https://evil.test/")
            assert tunnel.startswith("URLError Tunnel connection failed: 403 Forbidden (" + BLOCKED)
    finally:
        await upstream.stop()


async def test_pip_downloads_a_package_through_the_python_packages_preset(tmp_path: Path) -> None:
    """pip itself, isolated from this machine's pip config, fetches one small wheel via the proxy."""
    import sys

    policy = EgressPolicy.parse(["python-packages"])
    async with running_proxy(policy) as proxied, tcp_front(proxied.path) as port:
        cert = (
            ["--cert", "/etc/ssl/certs/ca-certificates.crt"]
            if Path("/etc/ssl/certs/ca-certificates.crt").exists()
            else []
        )
        code, out, err = await run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "--isolated",
            "--no-cache-dir",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "--timeout",
            "30",
            "--proxy",
            f"http://127.0.0.1:{port}",
            *cert,
            "-d",
            str(tmp_path),
            "six",
        )
        assert code == 0, out + err
        assert list(tmp_path.glob("six-*.whl"))
        # An allowed connection is recorded when its relay ends, which can trail pip's exit a little.
        with anyio.move_on_after(10):
            while {d.host for d in proxied.log.recent(50) if d.allowed} != set(policy.hosts):
                await anyio.sleep(0.05)
        hosts = {d.host for d in proxied.log.recent(50) if d.allowed}
        assert hosts == set(policy.hosts)  # the index, then its file host
        # And a host pip is not allowed: the denial reaches pip's output.
        code, out, err = await run(
            sys.executable,
            "-m",
            "pip",
            "download",
            "--isolated",
            "--no-cache-dir",
            "--no-deps",
            "--disable-pip-version-check",
            "--timeout",
            "10",
            "--retries",
            "1",
            "--proxy",
            f"http://127.0.0.1:{port}",
            *cert,
            "-d",
            str(tmp_path),
            "--index-url",
            "https://evil.test/simple",
            "six",
        )
        assert code != 0 and "403 Forbidden (" + BLOCKED in out + err
