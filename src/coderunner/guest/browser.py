"""The session's browser, inside the sandbox: Playwright's async API driving Debian's Chromium.

One persistent context per kernel, so it lives until a kernel reset or a session close (which end the
kernel and everything it started). User code reaches the same page:

    from coderunner_guest import browser
    page = await browser.page()
    await page.goto("file:///workspace/index.html")
"""

import base64
import json
import os
import pathlib
from typing import Any

from .errors import GuestError

OPS = ("navigate", "extract", "screenshot", "interact")
FORMATS = ("text", "html", "json", "table", "links")
ACTIONS = ("click", "fill", "press", "select", "scroll", "wait_for")
#: Bounds on what one answer carries.
TEXT_LIMIT = 20_000
ITEM_LIMIT = 500
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMIUM_ARGS = [
    "--no-sandbox",  # the whole browser already runs inside the CodeRunner sandbox
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-breakpad",
]
NETWORK_OFF = (
    "network is off for this session, so only pages from inside the sandbox load (file:///workspace/..., or a "
    "server started in the sandbox on localhost)"
)

NOTHING_LISTENS = (
    "nothing listens on that port inside the sandbox (localhost here is the sandbox's own); start the server "
    "in this session first, e.g. from run_python: subprocess.Popen(['python', '-m', 'http.server', '8000'])"
)
#: Names of the sandbox itself: a refused connection to one is a server not started, not the network.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0")

_state: dict[str, Any] = {}


def _executable():
    for candidate in CHROMIUM_CANDIDATES:
        if os.path.exists(candidate):
            return candidate
    raise GuestError("Chromium is not installed for the sandbox (Debian/Ubuntu: apt-get install chromium)")


async def page():
    """The session's page (created on first use), also for user code."""
    if _state.get("page") is None or _state["page"].is_closed():
        if _state.get("context") is None:
            _state["context"] = await _launch()
        _state["page"] = await _state["context"].new_page()
    return _state["page"]


async def _launch():
    """Start Playwright's driver and Chromium with the address-space limit lifted for them only.

    Chromium reserves about a terabyte of address space. The sandbox sets RLIMIT_AS as a soft limit
    only where a memory cgroup bounds real use; the kernel gets its soft limit back after the launch.
    """
    import resource

    from playwright.async_api import async_playwright

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and hard != resource.RLIM_INFINITY:
        raise GuestError(
            "the browser cannot start under this session's address-space limit (Chromium reserves ~1 TB of "
            "address space); it needs a memory cgroup to bound it instead: run the server as root or in a "
            "delegated cgroup (see coderunner doctor)"
        )
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    try:
        playwright = await async_playwright().start()
        _state["playwright"] = playwright
        # Network 'allowlist': the sandbox's only way out is the policy proxy (Chromium ignores the env).
        proxy = os.environ.get("CODERUNNER_EGRESS_PROXY")
        browser = await playwright.chromium.launch(
            executable_path=_executable(), args=CHROMIUM_ARGS, proxy={"server": proxy} if proxy else None
        )
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return await browser.new_context(viewport={"width": 1280, "height": 800})


async def run(op, args=None):
    if op not in OPS:
        raise GuestError(f"unknown browser op {op!r}; valid ops: {', '.join(OPS)}")
    return await globals()[f"_{op}"](**(args or {}))


def _milliseconds(timeout_s):
    return int(float(timeout_s or 30) * 1000)


async def _navigate(url, wait_for=None, timeout_s=30, file=None):
    """`file`: the sandbox path of a file:// URL, as the host confined it (its query and fragment kept)."""
    if file is not None:
        if not os.path.isfile(file):
            raise GuestError(f"could not load {url}: there is no file {file} in the sandbox")
        _, _, rest = url.partition("#")
        url = pathlib.Path(file).as_uri() + (f"#{rest}" if rest else "")
    current = await page()
    try:
        response = await current.goto(url, timeout=_milliseconds(timeout_s), wait_until="load")
        if wait_for:
            await current.wait_for_selector(wait_for, timeout=_milliseconds(timeout_s))
    except Exception as exc:
        message = str(exc).splitlines()[0]
        if "ERR_CONNECTION_REFUSED" in message and _in_sandbox(url):
            raise GuestError(f"could not load {url}: {NOTHING_LISTENS}") from None
        if _network_refused(message) and not url.startswith(("file:", "about:", "data:")):
            raise GuestError(f"could not load {url}: {NETWORK_OFF}") from None
        raise GuestError(f"could not load {url}: {message}") from None
    text = await current.inner_text("body") if await current.query_selector("body") else ""
    return {
        "url": current.url,
        "status": response.status if response is not None else None,
        "title": await current.title(),
        "text": text[:TEXT_LIMIT],
        "text_truncated": len(text) > TEXT_LIMIT,
        "links": await current.locator("a[href]").count(),
    }


def _in_sandbox(url):
    from urllib.parse import urlsplit

    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return False
    return host in LOOPBACK_HOSTS or host.startswith("127.") or host.endswith(".localhost")


def _network_refused(message):
    return any(
        code in message
        for code in (
            "ERR_NAME_NOT_RESOLVED",
            "ERR_NETWORK",
            "ERR_INTERNET_DISCONNECTED",
            "ERR_ADDRESS_UNREACHABLE",
            "ERR_CONNECTION_REFUSED",
            "ERR_PROXY",
        )
    )


async def _extract(selector, format="text", attribute=None, timeout_s=10):
    if format not in FORMATS:
        raise GuestError(f"unknown format {format!r}; use one of {', '.join(FORMATS)}")
    current = await page()
    locator = current.locator(selector)
    count = await locator.count()
    if count == 0:
        raise GuestError(f"no element matches {selector!r} on {current.url}")
    items = [locator.nth(index) for index in range(min(count, ITEM_LIMIT))]
    if format == "table":
        rows = await items[0].evaluate(_TABLE_JS)
        return {"selector": selector, "rows": rows[:ITEM_LIMIT], "count": len(rows)}
    if format == "links":
        links = await current.eval_on_selector_all(
            f"{selector} a[href], {selector}[href]", "els => els.map(e => ({text: e.innerText.trim(), href: e.href}))"
        )
        return {"selector": selector, "links": links[:ITEM_LIMIT], "count": len(links)}
    values = []
    for item in items:
        if attribute:
            values.append(await item.get_attribute(attribute))
        elif format == "html":
            values.append(await item.inner_html())
        elif format == "json":
            values.append(json.loads(await item.inner_text()))
        else:
            values.append(await item.inner_text())
    return {"selector": selector, "values": values, "count": count}


_TABLE_JS = """table => {
  const rows = Array.from(table.querySelectorAll('tr'));
  if (!rows.length) return [];
  const cells = row => Array.from(row.querySelectorAll('th,td')).map(c => c.innerText.trim());
  const header = table.querySelector('thead tr') || rows[0];
  const keys = cells(header);
  return rows.filter(r => r !== header).map(r => {
    const values = cells(r);
    return Object.fromEntries(keys.map((k, i) => [k || `column_${i + 1}`, values[i] ?? null]));
  });
}"""


async def _screenshot(full_page=False, selector=None, output="/workspace/screenshot.png"):
    current = await page()
    target = current.locator(selector).first if selector else current
    kwargs = {} if selector else {"full_page": bool(full_page)}
    data = await target.screenshot(path=output, **kwargs)
    return {"path": output, "url": current.url, "bytes": len(data), "preview": base64.b64encode(data).decode()}


async def _interact(action, selector, value=None, timeout_s=10):
    if action not in ACTIONS:
        raise GuestError(f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
    current = await page()
    locator = current.locator(selector).first
    timeout = _milliseconds(timeout_s)
    try:
        if action == "click":
            await locator.click(timeout=timeout)
        elif action == "fill":
            await locator.fill(str(value or ""), timeout=timeout)
        elif action == "press":
            await locator.press(str(value or "Enter"), timeout=timeout)
        elif action == "select":
            await locator.select_option(str(value), timeout=timeout)
        elif action == "scroll":
            await locator.scroll_into_view_if_needed(timeout=timeout)
        else:
            await locator.wait_for(timeout=timeout)
    except Exception as exc:
        raise GuestError(f"{action} on {selector!r} failed: {str(exc).splitlines()[0]}") from None
    return {"action": action, "selector": selector, "url": current.url, "title": await current.title()}
