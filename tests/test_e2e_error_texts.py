"""Errors that name the fix, through the MCP client: what a model sends by mistake and what it is told.

Each case is one a model hit (CodeRunner issue 28): the reply must say what to do, in the caller's terms,
never a library's raw text or a path only the server knows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.types import CallToolResult

from .conftest import ServerDirs, memory_client, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

MAKE_PDFS = """
from PIL import Image
pages = [Image.new('RGB', (200, 100), shade) for shade in ('white', 'gray', 'black')]
pages[0].save('doc.pdf', save_all=True, append_images=pages[1:])
pages[2].save('tail.pdf')
Image.new('RGB', (120, 80), 'white').save('pic.png')
'ready'
"""


def answer(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text_of(result)
    return result.structured_content or json.loads(text_of(result))


async def refusal(client: Client, tool: str, **arguments: Any) -> str:
    result = await client.call_tool(tool, arguments)
    assert result.is_error, text_of(result)
    return text_of(result)


@pytest.fixture
def folders(dirs: ServerDirs) -> tuple[Path, Path]:
    imports, out = dirs.root / "imports", dirs.root / "out"
    imports.mkdir(mode=0o755)
    out.mkdir(mode=0o755)
    (imports / "notes.txt").write_text("from the host\n")
    return imports, out


@pytest.fixture
async def client(dirs: ServerDirs, folders: tuple[Path, Path]) -> AsyncIterator[Client]:
    imports, out = folders
    env = server_env(dirs, CODERUNNER_IMPORT_DIRS=json.dumps([str(imports)]), CODERUNNER_EXPORT_DIR=str(out))
    async with memory_client(env) as connected:
        yield connected


async def test_a_session_s_first_reply_says_new_session_then_state_kept(client: Client) -> None:
    first = await run(client, "x = 1")
    assert "[kernel 1: new session]" in text_of(first) and "state kept" not in text_of(first), text_of(first)
    second = await run(client, "x")
    assert "[kernel 1: state kept]" in text_of(second), text_of(second)


async def test_a_timeout_past_max_timeout_s_is_refused_alike_by_run_python_and_create_session(client: Client) -> None:
    said = await refusal(client, "run_python", code="1", timeout_s=999999)
    assert "timeout_s must be between 0 and" in said and "(max_timeout_s)" in said, said
    assert said == await refusal(client, "create_session", timeout_s=999999)


async def test_documents_take_pages_as_numbers_say_merge_order_and_name_ocr_languages(client: Client) -> None:
    assert "ready" in text_of(await run(client, MAKE_PDFS))
    pdf = {"input_path": "doc.pdf"}
    one = answer(await client.call_tool("pdf_ops", {**pdf, "op": "extract_pages", "args": {"pages": 2}}))
    assert one["pages"] == 1
    two = await client.call_tool("pdf_ops", {"input_path": "doc.pdf", "op": "extract_text", "args": {"pages": [1, 3]}})
    assert [page["page"] for page in answer(two)["pages"]] == [1, 3]
    merged = answer(await client.call_tool("pdf_ops", {"input_path": "doc.pdf", "op": "merge",
                                                        "args": {"inputs": ["tail.pdf"]}}))  # fmt: skip
    assert merged["pages"] == 4 and merged["merged_in_order"] == ["/workspace/doc.pdf", "/workspace/tail.pdf"]
    lacking = await refusal(client, "pdf_ops", input_path="doc.pdf", op="merge")
    assert lacking.startswith("pdf_ops: merge needs inputs"), lacking
    assert lacking.count("pdf_ops") == 1, lacking
    parts = answer(await client.call_tool("pdf_ops", {**pdf, "op": "split", "args": {"ranges": "1,2-"}}))
    listed = answer(await client.call_tool("pdf_ops", {**pdf, "op": "split", "args": {"ranges": ["1", "2-"]}}))
    assert [part["pages"] for part in parts["files"]] == [part["pages"] for part in listed["files"]] == [1, 2], parts
    unknown = await refusal(client, "image_ops", input_path="pic.png", op="ocr", args={"lang": "klingon"})
    assert "'klingon'" in unknown and "installed: " in unknown and "eng" in unknown, unknown
    assert "TESSDATA" not in unknown and "Tesseract couldn't" not in unknown, unknown


async def test_transfers_name_the_user_s_folders(client: Client, folders: tuple[Path, Path]) -> None:
    imports, out = folders
    capabilities = answer(await client.call_tool("get_capabilities", {}))
    assert capabilities["files"]["import_dirs"] == [str(imports)]
    uploaded = answer(await client.call_tool("transfer_file", {"direction": "upload", "host_path": "notes.txt"}))
    assert uploaded["host_path"] == str(imports / "notes.txt") and uploaded["sandbox_path"] == "/workspace/notes.txt"
    first = answer(await client.call_tool("transfer_file", {"direction": "download", "sandbox_path": "notes.txt"}))
    exported = Path(first["host_path"])
    assert exported.parent.parent == out and exported.read_text() == "from the host\n"
    again = await refusal(client, "transfer_file", direction="download", sandbox_path="notes.txt")
    assert again.startswith(f"{exported} already exists") and "overwrite=true" in again, again
    assert "/export" not in again, again
    missing = await refusal(client, "transfer_file", direction="upload", host_path="absent.txt")
    assert missing.startswith(f"{imports / 'absent.txt'} does not exist"), missing


async def test_restore_takes_a_snapshot_s_name(client: Client) -> None:
    assert not (await run(client, "marker = 'older'")).is_error
    answer(await client.call_tool("manage_snapshots", {"action": "save", "name": "baseline"}))
    assert not (await run(client, "marker = 'newer'")).is_error
    newest = answer(await client.call_tool("manage_snapshots", {"action": "save", "name": "baseline"}))
    restored = answer(await client.call_tool("manage_snapshots", {"action": "restore", "snapshot": "baseline"}))
    assert restored["snapshot"] == newest["snapshot"]
    seen = await run(client, "marker", session_id=restored["session_id"])
    assert "'newer'" in text_of(seen) and "[kernel 1: new session, state restored]" in text_of(seen), text_of(seen)
    unknown = await refusal(client, "manage_snapshots", action="restore", snapshot="baselin")
    assert "'baselin'" in unknown and f"'baseline' ({newest['snapshot']})" in unknown, unknown


async def test_the_browser_tells_a_closed_port_and_a_relative_url_from_network_off(client: Client) -> None:
    closed = await refusal(client, "browser_navigate", url="http://127.0.0.1:8123/", timeout_s=10)
    assert "nothing listens on that port inside the sandbox" in closed and "network is off" not in closed, closed
    relative = await refusal(client, "browser_navigate", url="index.html")
    assert "needs an absolute URL" in relative and "file:///workspace/" in relative, relative
    outside = await refusal(client, "browser_navigate", url="file:///etc/passwd")
    assert "/etc/passwd is outside what the sandbox shares" in outside and "ERR_" not in outside, outside
    absent = await refusal(client, "browser_navigate", url="file:///workspace/nowhere.html")
    assert "there is no file /workspace/nowhere.html in the sandbox" in absent and "ERR_" not in absent, absent


async def test_code_that_fails_for_want_of_network_is_told_the_network_is_off(client: Client) -> None:
    looked_up = await run(client, "import socket\nsocket.getaddrinfo('example.com', 443)")
    assert looked_up.is_error and "gaierror" in text_of(looked_up), text_of(looked_up)
    said = text_of(looked_up)
    assert "[network is off in this session (network 'none')" in said, said
    # The user allows no network here: the way out is to ask them, never a mode above the ceiling.
    assert "ask the user" in said and "internet" not in said.split("[network is off")[1], said
    fetched = await run(client, "import urllib.request\nurllib.request.urlopen('http://example.com/', timeout=5)")
    assert fetched.is_error and "[network is off in this session" in text_of(fetched), text_of(fetched)
    # A server inside the sandbox that is not started yet is not the network being off.
    local = await run(client, "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)")
    assert local.is_error and "network is off" not in text_of(local), text_of(local)
    once = await client.call_tool("execute_code", {"language": "bash", "code": "curl -sS https://example.com/"})
    assert once.is_error and "network is off in this run (network 'none')" in text_of(once), text_of(once)
