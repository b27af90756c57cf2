"""Replies an agent can afford: session replies within a byte bound, each answer said once, and every cut
output saying how to read the rest (read_file within the cap of cell output). Through the real server.
"""

from __future__ import annotations

import json
import re

import pytest
from mcp import Client
from mcp.types import CallToolResult

from coderunner.config import Settings
from coderunner.tools.session_replies import BRIEF_BYTES

from .conftest import ServerDirs, json_of, run, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

#: The cap of cell output (the output_limit_chars setting's default), which read_file's text keeps to as well.
CAP = Settings.model_fields["output_limit_chars"].default
#: A float as noise prints it: more than one decimal.
FLOAT_NOISE = re.compile(r"\d\.\d{2,}")


def sent_bytes(result: CallToolResult) -> int:
    """What the reply puts on the wire for the model: its text, and a structured copy if there were one."""
    text = sum(len(block.text.encode()) for block in result.content if block.type == "text")
    copy = result.structured_content
    return text + (len(json.dumps(copy).encode()) if copy is not None else 0)


async def call(client: Client, tool: str, **arguments: object) -> CallToolResult:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    return result


async def test_session_replies_are_brief_and_status_is_full_without_host_paths(
    client: Client, dirs: ServerDirs
) -> None:
    created = await call(client, "create_session", memory_mb=1024)
    made = json_of(created)
    sid = made["session_id"]
    assert made == {"session_id": sid, "kernel": "idle", "network": "none", "timeout_s": made["timeout_s"],
                    "memory_mb": 1024, "default": False}  # fmt: skip
    await call(client, "create_session")
    await run(client, "x = 1", session_id=sid)
    reset = await call(client, "kernel_reset", session_id=sid)
    assert json_of(reset)["reset"] is True and json_of(reset)["session_id"] == sid
    listed = await call(client, "manage_sessions", action="list")
    entries = json_of(listed)["sessions"]
    assert sid in [entry["session_id"] for entry in entries] and len(entries) == 2
    closing = await call(client, "create_session")
    closed = await call(client, "manage_sessions", action="close", session_id=json_of(closing)["session_id"])
    for reply in (created, reset, closing, closed):
        assert reply.structured_content is None and sent_bytes(reply) <= BRIEF_BYTES, text_of(reply)
    assert all(len(json.dumps(entry)) <= BRIEF_BYTES for entry in entries)
    assert sent_bytes(listed) <= 2 * BRIEF_BYTES
    status = await call(client, "manage_sessions", action="status", session_id=sid)
    full = json_of(status)
    assert full["kernel_generation"] == 2 and full["limits"]["memory_mb"]["value"] == 1024
    assert full["usage"]["memory_mb"] > 0 and isinstance(full["usage"]["memory_mb"], int)
    assert {mount["sandbox"] for mount in full["mounts"]} == {"/mnt/outputs"}
    for reply in (created, reset, listed, closed, status):
        text = text_of(reply)
        assert str(dirs.root) not in text and "/var/lib" not in text and "isolation" not in text, text
        assert not FLOAT_NOISE.search(text), text
    capabilities = json_of(await call(client, "get_capabilities"))
    assert "seccomp" in capabilities["sandbox"]["isolation"]  # how the sandbox is built: said there, once


async def test_execute_code_says_its_answer_once_and_marks_the_cut(client: Client) -> None:
    result = await call(client, "execute_code", language="python", code="print('y' * 20_000 + 'END')")
    done = json_of(result)
    assert result.structured_content is None and [block.type for block in result.content] == ["text"]
    assert sent_bytes(result) < CAP + 1_000  # 20 KB of output was 41 KB on the wire: text and a copy
    assert done["truncated"] is True and done["stdout"].rstrip().endswith("END")
    assert "[... 4 bytes omitted (a one-shot run keeps no copy)]" in done["stdout"]
    assert done["limits"]["memory_mb"] == 2048 and done["limits"]["network"] == "none"


async def test_cut_cell_output_says_where_the_rest_is_and_read_file_reads_it(client: Client) -> None:
    result = await run(client, f"print('é' * {CAP // 2} + 'MIDDLE' + 'q' * 30_000)")
    text = text_of(result)
    marker = re.search(r"full output: (\S+) \(read_file offset=(\d+) for what is omitted here\)\]", text)
    assert marker is not None and "characters omitted" in text and "MIDDLE" not in text, text[CAP // 2 - 100 :][:400]
    path, offset = marker.group(1), int(marker.group(2))
    assert offset == CAP  # in bytes: the head's CAP / 2 characters are two bytes each
    rest = text_of(await call(client, "read_file", path=path, offset=offset, length=20))
    assert rest.startswith("MIDDLE" + "q" * 14)  # the omitted part, from its first character


async def test_read_file_keeps_to_the_cap_of_cell_output_and_names_the_next_range(client: Client) -> None:
    await run(client, "open('big.txt', 'w').write('a' * 19_999 + 'é' + 'b' * 40_000 + 'END')")
    first = await call(client, "read_file", path="big.txt")
    text = text_of(first)
    assert len(text.encode()) < CAP + 200 and text.startswith("a" * 19_999)
    assert "é" not in text  # a character the cap would cut goes to the next range, whole
    note = re.search(r"\[bytes 0-19,999 of 60,004; next: read_file path=/workspace/big.txt offset=(\d+)\]", text)
    assert note is not None, text[-200:]
    offset = int(note.group(1))
    second = text_of(await call(client, "read_file", path="big.txt", offset=offset))
    assert second.startswith("é" + "b" * 100) and f"offset={offset + CAP}" in second
    last = text_of(await call(client, "read_file", path="big.txt", offset=60_001))
    assert last.startswith("END") and "end of file" in last
    long_line = text_of(await call(client, "read_file", path="big.txt", start_line=1))
    assert "[line 1 is over the size limit: read it with offset/length]" in long_line, long_line[-200:]
    await run(client, "open('rows.txt', 'w').write(''.join(f'{i:099d}\\n' for i in range(500)))")
    rows = text_of(await call(client, "read_file", path="rows.txt", start_line=1))
    assert len(rows.encode()) < CAP + 200 and rows.startswith("0" * 99 + "\n")
    assert rows.endswith(
        "[lines 1-200; stopped at the size limit; next: read_file path=/workspace/rows.txt start_line=201]"
    )


async def test_image_info_is_metadata_without_a_preview(client: Client) -> None:
    await run(client, "from PIL import Image\nImage.new('RGB', (800, 600), 'red').save('red.png')")
    info = await call(client, "image_ops", op="info", input_path="red.png")
    assert [block.type for block in info.content] == ["text"]
    assert json_of(info) == {"path": "/workspace/red.png", "width": 800, "height": 600, "mode": "RGB",
                             "format": "PNG", "bytes": json_of(info)["bytes"]}  # fmt: skip
    assert sent_bytes(info) < 200


async def test_a_job_read_that_skips_output_says_where_the_skipped_part_is(client: Client) -> None:
    # The first reply takes "first" (as a rule): the skipped part then starts past what it showed.
    code = "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('a' * 2_000 + 'SKIP' + 'b' * 22_000)"
    started = await run(client, code, detach_after_s=1)
    job_id = (started.meta or {})["coderunner/job"]["job_id"]
    waited = text_of(await call(client, "manage_jobs", action="wait", job_id=job_id, timeout_s=60))
    marker = re.search(
        r"\[\.\.\. ([\d,]+) characters not shown here; full output: (\S+) \(read_file offset=(\d+) for them\)\]\n",
        waited,
    )
    assert marker is not None, waited[:300]
    skipped, path, offset = int(marker.group(1).replace(",", "")), marker.group(2), int(marker.group(3))
    shown = waited[marker.end() :].split("\n[job ")[0] + "\n"  # the reply's text leaves out the last newline
    assert len(shown) == CAP  # the window of unread output a read keeps
    missed = text_of(await call(client, "read_file", path=path, offset=offset, length=skipped)).split("\n[bytes ")[0]
    whole = "first\n" + "a" * 2_000 + "SKIP" + "b" * 22_000 + "\n"
    assert missed + shown == whole[-(skipped + len(shown)) :] and len(missed) == skipped
