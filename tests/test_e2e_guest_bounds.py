"""Guest tools answer plainly and within bounds: every op with minimal arguments, and a hostile answer.

The sandbox can rewrite the guest modules loaded in its own kernel, so whatever a guest tool
answers is untrusted: the host must bound it like any cell output.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from mcp import Client

from .conftest import ServerDirs, images_of, memory_client, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

MAKE_INPUTS = """
from PIL import Image
Image.new('RGB', (120, 80), 'white').save('pic.png')
pdf = Image.new('RGB', (200, 100), 'white')
pdf.save('doc.pdf', save_all=True, append_images=[Image.new('RGB', (200, 100), 'gray')])
'inputs ready'
"""
#: What only Python itself says: none of it may reach the caller.
RAW_MARKERS = ("Traceback", "TypeError", "positional argument", "_to_images", "Error:", "object has no attribute")
#: Ops that need an argument, and the argument each reply must name.
PDF_NEEDS = {"merge": "needs inputs", "rotate": "needs degrees", "extract_pages": "needs pages",
             "encrypt": "needs password", "decrypt": "needs password"}  # fmt: skip
IMAGE_NEEDS = {"crop": "needs box", "rotate": "needs degrees", "resize": "width and/or height"}
PDF_OPS = ("info", "extract_text", "merge", "split", "rotate", "extract_pages", "to_images", "encrypt", "decrypt")
IMAGE_OPS = ("info", "resize", "thumbnail", "crop", "rotate", "flip", "convert", "grayscale", "ocr")


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    async with memory_client(server_env(dirs)) as connected:
        made = await run(connected, MAKE_INPUTS)
        assert not made.is_error, text_of(made)
        yield connected


def plain(text: str) -> bool:
    return not any(marker in text for marker in RAW_MARKERS)


@pytest.mark.parametrize(
    ("tool", "path", "ops", "needs"),
    [("pdf_ops", "doc.pdf", PDF_OPS, PDF_NEEDS), ("image_ops", "pic.png", IMAGE_OPS, IMAGE_NEEDS)],
)
async def test_every_op_with_minimal_arguments_answers_plainly(
    client: Client, tool: str, path: str, ops: tuple[str, ...], needs: dict[str, str]
) -> None:
    for name in ops:
        result = await client.call_tool(tool, {"input_path": path, "op": name})
        text = text_of(result)
        assert plain(text), f"{tool} {name}: {text}"
        if name in needs:
            assert result.is_error and needs[name] in text, f"{tool} {name}: {text}"
        elif not (tool == "image_ops" and name == "ocr" and "Tesseract is not installed" in text):
            assert not result.is_error, f"{tool} {name}: {text}"


async def test_to_images_without_output_prefix_writes_beside_the_pdf(client: Client) -> None:
    result = await client.call_tool("pdf_ops", {"input_path": "doc.pdf", "op": "to_images"})
    assert not result.is_error, text_of(result)
    paths = [entry["path"] for entry in json.loads(text_of(result))["files"]]
    assert paths == ["/workspace/doc-page-1.png", "/workspace/doc-page-2.png"]
    assert len(images_of(result)) == 2


async def test_wrong_arguments_are_named_not_raised(client: Client) -> None:
    unknown = await client.call_tool("pdf_ops", {"input_path": "doc.pdf", "op": "info", "colour": 1})
    assert unknown.is_error and "unknown argument 'colour'" in text_of(unknown) and plain(text_of(unknown))
    assert "args" in text_of(unknown) and "validation error" not in text_of(unknown)
    inner = await client.call_tool("pdf_ops", {"input_path": "doc.pdf", "op": "info", "args": {"colour": 1}})
    assert inner.is_error and "unknown argument 'args.colour' (args takes: pages" in text_of(inner), text_of(inner)
    wrong_op = await client.call_tool("pdf_ops", {"input_path": "doc.pdf", "op": "info", "args": {"degrees": 90}})
    assert wrong_op.is_error and "unknown argument(s) degrees" in text_of(wrong_op) and plain(text_of(wrong_op))
    crop = {"input_path": "pic.png", "op": "crop"}
    typed = await client.call_tool("image_ops", {**crop, "args": {"box": ["a", 0, 5, 5]}})
    assert typed.is_error and "image_ops: args.box.0" in text_of(typed) and plain(text_of(typed))
    assert "input_value" not in text_of(typed) and "errors.pydantic" not in text_of(typed)
    short = await client.call_tool("image_ops", {"input_path": "pic.png", "op": "crop", "args": {"box": [0, 0, 5]}})
    assert short.is_error and "four whole numbers" in text_of(short) and plain(text_of(short))
    corrupt = await run(client, "open('bad.pdf', 'wb').write(b'%PDF-1.7\\n' + bytes(range(256)) * 8)")
    assert not corrupt.is_error
    bad = await client.call_tool("pdf_ops", {"input_path": "bad.pdf", "op": "extract_text"})
    assert bad.is_error and "pdf_ops: extract_text" in text_of(bad) and plain(text_of(bad)), text_of(bad)


#: Sandboxed code swaps a guest op for one that answers with far more than a reply may carry.
HOSTILE_ANSWER = """
import base64, io
import coderunner_guest.image as guest
from PIL import Image
buffer = io.BytesIO(); Image.new('RGB', (4, 4), 'red').save(buffer, 'PNG')
tiny = base64.b64encode(buffer.getvalue()).decode()
guest.run = lambda **_: {"previews": [tiny] * 20000, "text": "A" * 3_000_000 + "END-OF-ANSWER"}
'swapped'
"""
#: Another op raises with a text that must not reach the caller.
HOSTILE_RAISE = """
import coderunner_guest.pdf as guest
def boom(**_):
    raise RuntimeError('INTERNAL-DETAIL-7f3a')
guest.run = boom
'swapped'
"""


async def test_a_hostile_guest_answer_is_bounded_like_cell_output(client: Client) -> None:
    bystander = json.loads(text_of(await client.call_tool("create_session", {})))["session_id"]
    assert not (await run(client, MAKE_INPUTS, session_id=bystander)).is_error
    assert "swapped" in text_of(await run(client, HOSTILE_ANSWER))
    result = await client.call_tool("image_ops", {"input_path": "pic.png", "op": "info"})
    assert not result.is_error, text_of(result)[:500]
    assert len(images_of(result)) <= 20
    text = text_of(result)
    assert len(text) < 30_000 and "characters omitted" in text and "previews not shown" in text
    assert result.structured_content is None
    spilled = text.split("full output: ")[1].split("]")[0].split(" (")[0]
    assert spilled.startswith("/workspace/.coderunner/")
    tail = await run(client, f"open({spilled!r}).read()[-200:]")
    assert "END-OF-ANSWER" in text_of(tail)
    assert "swapped" in text_of(await run(client, HOSTILE_RAISE))
    raised = await client.call_tool("pdf_ops", {"input_path": "doc.pdf", "op": "info"})
    assert raised.is_error and "INTERNAL-DETAIL" not in text_of(raised) and "pdf_ops: info" in text_of(raised)
    # The server and a bystander session still serve.
    assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"
    assert text_of(await run(client, "1 + 1", session_id=bystander)).splitlines()[0] == "2"
    fine = await client.call_tool("image_ops", {"input_path": "pic.png", "op": "info", "session_id": bystander})
    assert not fine.is_error and json.loads(text_of(fine))["width"] == 120
