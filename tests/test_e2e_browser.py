"""The browser tools through the MCP client, against a page served from inside the sandbox."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from mcp import Client

from .conftest import ServerDirs, images_of, memory_client, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

APP = """<!doctype html>
<html><head><title>Price board</title></head>
<body>
  <h1>Prices</h1>
  <div id="board">loading...</div>
  <form onsubmit="return false">
    <input id="qty" type="number" value="1">
    <select id="item">
      <option value="9.99">widget</option><option value="4.50">gadget</option>
    </select>
    <button id="calc" onclick="const v = id => document.getElementById(id).value;
      document.getElementById('result').innerText = 'Total: ' + (v('qty') * v('item')).toFixed(2)">Calc</button>
  </form>
  <p id="result"></p>
  <a href="/about.html">about</a>
  <script>
    setTimeout(() => {
      const rows = [["widget", "9.99"], ["gadget", "4.50"], ["doohickey", "12.00"]];
      document.getElementById('board').innerHTML = '<table id="prices">'
        + '<thead><tr><th>item</th><th>price</th></tr></thead><tbody>'
        + rows.map(r => `<tr><td class="name">${r[0]}</td><td class="price">${r[1]}</td></tr>`).join('')
        + '</tbody></table>';
    }, 800);
  </script>
</body></html>
"""

SERVE = """
import subprocess, sys, time, urllib.request
server = subprocess.Popen([sys.executable, '-m', 'http.server', '8000', '--bind', '127.0.0.1'], cwd='/workspace/app',
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(100):
    try:
        urllib.request.urlopen('http://127.0.0.1:8000/', timeout=1); break
    except OSError:
        time.sleep(0.05)
'serving'
"""


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    async with memory_client(server_env(dirs)) as connected:
        written = await connected.call_tool("write_file", {"path": "app/index.html", "content": APP})
        assert not written.is_error, text_of(written)
        yield connected


async def tool(client: Client, name: str, **arguments: object) -> dict:  # type: ignore[type-arg]
    result = await client.call_tool(name, arguments)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def test_single_page_app_served_inside_the_sandbox(client: Client) -> None:
    assert "serving" in text_of(await run(client, SERVE))
    page = await tool(client, "browser_navigate", url="http://127.0.0.1:8000/index.html", wait_for="table#prices")
    assert page["status"] == 200 and page["title"] == "Price board" and page["links"] == 1
    assert "doohickey" in page["text"], "the text is read after the delayed render"

    table = await tool(client, "browser_extract", selector="table#prices", format="table")
    assert table["rows"] == [
        {"item": "widget", "price": "9.99"},
        {"item": "gadget", "price": "4.50"},
        {"item": "doohickey", "price": "12.00"},
    ]
    wrong = await client.call_tool("browser_extract", {"selector": "td.cost"})
    assert wrong.is_error and "no element matches 'td.cost'" in text_of(wrong)
    prices = await tool(client, "browser_extract", selector="td.price")
    assert prices["values"] == ["9.99", "4.50", "12.00"]
    links = await tool(client, "browser_extract", selector="body", format="links")
    assert links["links"][0]["href"] == "http://127.0.0.1:8000/about.html"

    shot = await client.call_tool("browser_screenshot", {"full_page": True})
    assert not shot.is_error, text_of(shot)
    png = images_of(shot)[0]
    assert png.startswith(b"\x89PNG") and len(png) > 2000
    element = await client.call_tool("browser_screenshot", {"selector": "table#prices", "output": "shots/table.png"})
    assert json.loads(text_of(element))["path"] == "/workspace/shots/table.png"


async def test_interact_fills_a_form_and_reads_the_result(client: Client) -> None:
    await tool(client, "browser_navigate", url="file:///workspace/app/index.html")
    await tool(client, "browser_interact", action="fill", selector="#qty", value="3")
    await tool(client, "browser_interact", action="select", selector="#item", value="4.50")
    await tool(client, "browser_interact", action="click", selector="#calc")
    await tool(client, "browser_interact", action="wait_for", selector="#result:has-text('Total')")
    result = await tool(client, "browser_extract", selector="#result")
    assert result["values"] == ["Total: 13.50"]
    missing = await client.call_tool("browser_interact", {"action": "click", "selector": "#nope", "timeout_s": 1})
    assert missing.is_error and "click on '#nope' failed" in text_of(missing)


async def test_with_network_off_web_pages_fail_and_say_why(client: Client) -> None:
    blocked = await client.call_tool("browser_navigate", {"url": "https://example.com/", "timeout_s": 10})
    assert blocked.is_error
    # The user allows no network here: the way out is to ask them, not a mode above their ceiling.
    assert "network is off" in text_of(blocked) and "ask the user" in text_of(blocked), text_of(blocked)
    assert "network='internet'" not in text_of(blocked)


async def test_user_code_drives_the_same_page_and_reset_closes_the_browser(client: Client) -> None:
    await tool(client, "browser_navigate", url="file:///workspace/app/index.html")
    same = await run(client, "from coderunner_guest import browser\npage = await browser.page()\nawait page.title()")
    assert "'Price board'" in text_of(same)
    await run(client, "await page.evaluate(\"document.getElementById('result').innerText = 'from user code'\")")
    seen = await tool(client, "browser_extract", selector="#result")
    assert seen["values"] == ["from user code"], "the tools and user code share one page"
    reset = await client.call_tool("kernel_reset", {})
    assert not reset.is_error
    fresh = await run(client, "from coderunner_guest import browser\nsorted(browser._state)")
    assert "[]" in text_of(fresh), "a kernel reset ends the browser with the kernel"
    again = await tool(client, "browser_navigate", url="file:///workspace/app/index.html")
    assert again["title"] == "Price board"
