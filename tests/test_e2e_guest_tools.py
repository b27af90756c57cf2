"""pdf_ops and image_ops (PDFs and images) through the MCP client: every op on inputs the tests make, then bad input.

The inputs are made inside the sandbox (with the sandbox's own matplotlib and Pillow), as an
agent would; the host only ever sees the tools' answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import pytest
from mcp import Client

from .conftest import ServerDirs, images_of, memory_client, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

MAKE_INPUTS = """
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
from matplotlib.backends.backend_pdf import PdfPages
from PIL import Image, ImageDraw
with PdfPages('report.pdf') as pdf:
    for n in range(1, 5):
        fig = plt.figure(figsize=(4, 3))
        fig.text(0.1, 0.5, f'Page {n} quarterly revenue', fontsize=14)
        pdf.savefig(fig)
        plt.close(fig)
with PdfPages('extra.pdf') as pdf:
    fig = plt.figure(figsize=(4, 3)); fig.text(0.1, 0.5, 'Appendix'); pdf.savefig(fig); plt.close(fig)
image = Image.new('RGB', (600, 200), 'white')
ImageDraw.Draw(image).text((20, 70), 'INVOICE 2026 TOTAL 314', fill='black', font_size=40)
image.save('scan.png')
Image.new('RGBA', (300, 200), (200, 30, 30, 255)).save('red.png')
open('corrupt.pdf', 'wb').write(b'%PDF-1.7\\n' + bytes(range(256)) * 20)
open('notes.txt', 'w').write('this is not an image')
import struct, zlib
def chunk(kind, data):
    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff)
bomb = b'\\x89PNG\\r\\n\\x1a\\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', 60000, 60000, 1, 0, 0, 0, 0))
bomb += chunk(b'IDAT', zlib.compress(b'\\x00' * 1000)) + chunk(b'IEND', b'')
open('bomb.png', 'wb').write(bomb)
'inputs ready'
"""


@pytest.fixture
async def client(dirs: ServerDirs) -> AsyncIterator[Client]:
    async with memory_client(server_env(dirs)) as connected:
        made = await run(connected, MAKE_INPUTS)
        assert not made.is_error, text_of(made)
        yield connected


async def op(client: Client, tool: str, input_path: str, name: str, **args: object) -> dict:  # type: ignore[type-arg]
    result = await client.call_tool(tool, {"input_path": input_path, "op": name, "args": args})
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


async def refused(client: Client, tool: str, input_path: str, name: str, needle: str, **args: object) -> None:
    result = await client.call_tool(tool, {"input_path": input_path, "op": name, "args": args})
    assert result.is_error, text_of(result)
    assert needle in text_of(result), text_of(result)


async def test_every_pdf_op(client: Client) -> None:
    info = await op(client, "pdf_ops", "report.pdf", "info")
    assert info["pages"] == 4 and info["encrypted"] is False
    text = await op(client, "pdf_ops", "report.pdf", "extract_text", pages="2-3")
    assert [page["page"] for page in text["pages"]] == [2, 3] and "Page 2 quarterly" in text["pages"][0]["text"]
    merged = await op(client, "pdf_ops", "report.pdf", "merge", inputs=["extra.pdf"], output="out/merged.pdf")
    assert merged["pages"] == 5 and merged["path"] == "/workspace/out/merged.pdf"
    split = await op(client, "pdf_ops", "report.pdf", "split", ranges="1-2,3-4", output_prefix="out/part")
    assert [part["pages"] for part in split["files"]] == [2, 2]
    rotated = await op(client, "pdf_ops", "report.pdf", "rotate", degrees=90, pages="1", output="out/rotated.pdf")
    assert rotated["pages"] == 4
    check = await run(client, "from pypdf import PdfReader\n[p.rotation for p in PdfReader('out/rotated.pdf').pages]")
    assert "[90, 0, 0, 0]" in text_of(check)
    extracted = await op(client, "pdf_ops", "report.pdf", "extract_pages", pages="4,1", output="out/two.pdf")
    assert extracted["pages"] == 2
    result = await client.call_tool(
        "pdf_ops", {"input_path": "report.pdf", "op": "to_images", "args": {"pages": "1-2", "output_prefix": "png/p"}}
    )
    assert not result.is_error, text_of(result)
    assert [entry["path"] for entry in json.loads(text_of(result))["files"]] == [
        "/workspace/png/p-1.png",
        "/workspace/png/p-2.png",
    ]
    assert all(image.startswith(b"\x89PNG") for image in images_of(result)) and len(images_of(result)) == 2
    await op(client, "pdf_ops", "report.pdf", "encrypt", password="s3cret", output="out/locked.pdf")
    locked = await op(client, "pdf_ops", "out/locked.pdf", "info")
    assert locked["encrypted"] is True and "pages" not in locked
    await refused(client, "pdf_ops", "out/locked.pdf", "extract_text", "is encrypted: pass password")
    await refused(client, "pdf_ops", "out/locked.pdf", "decrypt", "wrong password", password="nope", output="x.pdf")
    opened = await op(client, "pdf_ops", "out/locked.pdf", "decrypt", password="s3cret", output="out/open.pdf")
    assert opened["pages"] == 4
    assert (await op(client, "pdf_ops", "out/open.pdf", "info"))["encrypted"] is False


async def test_every_image_op(client: Client) -> None:
    info = await op(client, "image_ops", "scan.png", "info")
    assert (info["width"], info["height"], info["format"]) == (600, 200, "PNG")
    assert (await op(client, "image_ops", "scan.png", "resize", width=300))["height"] == 100
    assert (await op(client, "image_ops", "scan.png", "resize", width=50, height=50, keep_aspect=False))["width"] == 50
    assert (await op(client, "image_ops", "scan.png", "thumbnail", size=64))["width"] == 64
    cropped = await op(client, "image_ops", "scan.png", "crop", box=[0, 0, 100, 50])
    assert (cropped["width"], cropped["height"]) == (100, 50)
    assert (await op(client, "image_ops", "scan.png", "rotate", degrees=90))["width"] == 200
    assert (await op(client, "image_ops", "red.png", "flip", direction="vertical"))["path"].endswith("-flipped.png")
    for fmt, expected in (("jpeg", "JPEG"), ("webp", "WEBP"), ("gif", "GIF"), ("bmp", "BMP"), ("tiff", "TIFF")):
        converted = await op(client, "image_ops", "red.png", "convert", format=fmt, output=f"conv/red.{fmt}")
        assert converted["format"] == expected
    gray = await op(client, "image_ops", "red.png", "grayscale")
    mode = await run(client, f"from PIL import Image\nImage.open({gray['path']!r}).mode")
    assert "'L'" in text_of(mode)
    preview = await client.call_tool("image_ops", {"input_path": "scan.png", "op": "thumbnail", "args": {"size": 32}})
    assert images_of(preview)[0].startswith(b"\x89PNG")
    ocr = await op(client, "image_ops", "scan.png", "ocr")
    assert "INVOICE 2026 TOTAL 314" in ocr["text"]


async def test_bad_input_gets_a_clear_error_and_the_session_keeps_serving(client: Client) -> None:
    await run(client, "kept = 'state survives bad input'")
    await refused(client, "pdf_ops", "corrupt.pdf", "info", "pdf_ops:")
    await refused(client, "image_ops", "notes.txt", "info", "not an image Pillow can read")
    await refused(client, "image_ops", "bomb.png", "info", "too large to decode safely")
    await refused(client, "image_ops", "scan.png", "resize", "too large", width=100000, height=100000,
                  keep_aspect=False)  # fmt: skip
    await refused(client, "image_ops", "missing.png", "info", "does not exist")
    await refused(client, "image_ops", "/etc/passwd", "info", "outside what the sandbox shares")
    outside = "outside what the sandbox shares"
    await refused(client, "pdf_ops", "report.pdf", "merge", outside, inputs=["/etc/hosts"], output="m.pdf")
    await refused(client, "image_ops", "scan.png", "resize", "outside what the sandbox shares", width=10,
                  output="/usr/lib/evil.png")  # fmt: skip
    for tool, path, name in (("image_ops", "scan.png", "sharpen"), ("pdf_ops", "report.pdf", "explode")):
        await refused(client, tool, path, name, "op: Input should be 'info', ")
    after = await run(client, "kept")
    assert "'state survives bad input'" in text_of(after)
    names = await run(client, "sorted(k for k in dir() if not k.startswith('_') and k not in ('In', 'Out'))")
    assert "call" not in text_of(names) and "dispatch" not in text_of(names)


async def test_a_guest_call_on_a_busy_kernel_answers_busy_without_deadlock(client: Client) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, client, "import time\ntime.sleep(5)")
        await anyio.sleep(0.8)
        with anyio.fail_after(10):
            busy = await client.call_tool("image_ops", {"input_path": "scan.png", "op": "info", "timeout_s": 1})
        assert busy.is_error and "busy" in text_of(busy)
    assert not (await client.call_tool("image_ops", {"input_path": "scan.png", "op": "info"})).is_error
