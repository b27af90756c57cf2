"""Outputs that always arrive: figures under any matplotlib backend, typed resource reads, files named in
text for clients that cannot follow links, and OAuth discovery that sends clients back to the token."""

from __future__ import annotations

import base64

import httpx2
import pytest
from mcp import Client

from .conftest import ServerDirs, http_server, images_of, json_of, memory_client, run, server_env, text_of

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

PLOT = "fig, ax = plt.subplots()\nax.plot([1, 4, 9])\n"


def pngs(result: object) -> list[bytes]:
    images = images_of(result)  # type: ignore[arg-type]
    assert all(image.startswith(b"\x89PNG\r\n\x1a\n") for image in images)
    return images


async def test_figures_arrive_once_whatever_the_backend(client: Client) -> None:
    # Agg then plt.show(): shows nothing by itself, and must not warn about it either.
    agg = await run(client, "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                            + PLOT + "plt.show()")  # fmt: skip
    assert len(pngs(agg)) == 1 and "cannot be shown" not in text_of(agg)
    # Left open without show(), two of them: both, once each; the next cell sends neither again.
    two = await run(client, PLOT + PLOT)
    assert len(pngs(two)) == 2
    assert pngs(await run(client, "1 + 1")) == []
    # Saved and closed by the code itself: nothing to send.
    closed = await run(client, PLOT + "fig.savefig('chart.png')\nplt.close(fig)")
    assert pngs(closed) == []
    # Back to the inline backend: its own hook sends the figure, and ours does not send it a second time.
    inline = await run(client, "%matplotlib inline\n" + PLOT + "plt.show()")
    assert len(pngs(inline)) == 1
    left_open = await run(client, PLOT)
    assert len(pngs(left_open)) == 1


async def test_a_figure_that_cannot_be_drawn_says_so_and_the_kernel_serves(client: Client) -> None:
    broken = await run(client, "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                               "fig = plt.figure()\nfig.set_size_inches(1e6, 1e6)")  # fmt: skip
    assert "a figure could not be sent as an image" in text_of(broken)
    assert text_of(await run(client, "6 * 7")).splitlines()[0] == "42"
    assert pngs(await run(client, "1")) == []  # closed even though it failed


async def test_a_pil_image_arrives_once_and_html_or_markdown_as_their_text(client: Client) -> None:
    # A PIL image offers PNG and JPEG: one image, the PNG.
    image = await run(client, "from PIL import Image\nImage.new('RGB', (8, 8), 'red')")
    assert len(pngs(image)) == 1, text_of(image)
    shown = await run(
        client,
        "from IPython.display import HTML, Markdown, display\n"
        "display(HTML('<b>bold</b> text'))\ndisplay(Markdown('# A title'))\nHTML('<i>last</i>')",
    )
    text = text_of(shown)
    assert "<b>bold</b> text" in text and "# A title" in text and "<i>last</i>" in text, text
    assert "IPython.core.display" not in text, text


async def test_resource_reads_carry_the_mime_type_and_text_as_text(client: Client) -> None:
    await run(client, "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
                      + PLOT + "fig.savefig('chart.png')\nplt.close(fig)\n"
                      "open('table.csv', 'w').write('x,y\\n1,2\\n')\nopen('blob.bin', 'wb').write(bytes(range(256)))\n"
                      "open('notes', 'w').write('héllo')")  # fmt: skip
    session = json_of(await client.call_tool("manage_sessions", {"action": "status"}))
    assert session is not None
    base = f"sandbox://{session['session_id']}/workspace/"
    png = (await client.read_resource(base + "chart.png")).contents[0]
    assert png.mime_type == "image/png" and base64.b64decode(png.blob).startswith(b"\x89PNG")  # type: ignore[union-attr]
    csv = (await client.read_resource(base + "table.csv")).contents[0]
    assert csv.mime_type == "text/csv" and csv.text == "x,y\n1,2\n"  # type: ignore[union-attr]
    plain = (await client.read_resource(base + "notes")).contents[0]
    assert plain.mime_type == "text/plain" and plain.text == "héllo"  # type: ignore[union-attr]
    blob = (await client.read_resource(base + "blob.bin")).contents[0]
    assert blob.mime_type == "application/octet-stream"
    assert base64.b64decode(blob.blob) == bytes(range(256))  # type: ignore[union-attr]


async def test_file_links_text_names_files_without_resource_links(dirs: ServerDirs) -> None:
    async with memory_client(server_env(dirs, CODERUNNER_FILE_LINKS="text")) as client:
        spilled = await run(client, "for i in range(100_000):\n    print('row', i)")
        assert [block.type for block in spilled.content] == ["text"]
        assert "full output: /workspace/" in text_of(spilled)
        await run(client, "open('big.bin', 'wb').write(bytes(1_000_000))")
        big = await client.call_tool("read_file", {"path": "big.bin"})
        assert [block.type for block in big.content] == ["text"]
        assert "/workspace/big.bin: 1,000,000 bytes" in text_of(big) and "transfer_file (download)" in text_of(big)


async def test_oauth_discovery_answers_404_so_clients_send_the_token(dirs: ServerDirs) -> None:
    with http_server(server_env(dirs)) as url:
        root = url.removesuffix("/mcp")
        for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp",
                     "/.well-known/oauth-authorization-server", "/.well-known/openid-configuration"):  # fmt: skip
            answer = httpx2.get(root + path, timeout=30)
            assert answer.status_code == 404, path
            assert "Bearer" in answer.json()["error_description"]
        # Everything else still needs the token.
        assert httpx2.get(url, timeout=30).status_code == 401
