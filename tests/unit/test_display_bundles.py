"""How one display bundle becomes reply content (kernel/execution.py): one image, and text that says something.

The real kernel's bundles (a PIL image, IPython's HTML and Markdown) are in tests/test_e2e_outputs.py.
"""

from __future__ import annotations

import base64

from coderunner.kernel.channels import Message
from coderunner.kernel.execution import RunState, display_text
from coderunner.kernel.output_capture import OutputCollector

PNG = base64.b64encode(b"\x89PNG" + bytes(600)).decode()
JPEG = base64.b64encode(b"\xff\xd8\xff" + bytes(100)).decode()


def shown(data: dict[str, object], image_limit_bytes: int = 10_000) -> OutputCollector:
    output = OutputCollector(limit_chars=10_000, spill_limit_bytes=0, image_limit_bytes=image_limit_bytes)
    RunState(msg_id="parent", output=output).handle(Message("display_data", "parent", {"data": data, "metadata": {}}))
    return output


def test_a_display_with_png_and_jpeg_sends_one_image_the_png() -> None:
    output = shown({"image/png": PNG, "image/jpeg": JPEG, "text/plain": "<PIL.Image.Image image mode=RGB>"})
    assert [image.mime_type for image in output.images] == ["image/png"]
    assert "PIL.Image.Image image mode=RGB" in output.text()


def test_the_jpeg_is_sent_when_only_it_fits_in_the_reply() -> None:
    output = shown({"image/png": PNG, "image/jpeg": JPEG}, image_limit_bytes=len(JPEG) + 10)
    assert [image.mime_type for image in output.images] == ["image/jpeg"]
    # Neither fits: the richest is the one kept (saved to the workspace when the run has a writer).
    none_fit = shown({"image/png": PNG, "image/jpeg": JPEG}, image_limit_bytes=10)
    assert none_fit.images == [] and none_fit.dropped_images == 1


def test_a_bare_repr_gives_way_to_the_html_markdown_or_json_it_stands_for() -> None:
    assert display_text({"text/plain": "<IPython.core.display.HTML object>", "text/html": "<b>x</b>"}) == "<b>x</b>"
    both = {"text/plain": "<IPython.core.display.Markdown object>", "text/markdown": "# T", "text/html": "<h1>T</h1>"}
    assert display_text(both) == "# T"
    assert display_text({"text/plain": "<x.Y object at 0x7f3a>", "application/json": {"a": 1}}) == '{\n "a": 1\n}'
    assert display_text({"text/html": "<i>only html</i>"}) == "<i>only html</i>"


def test_a_text_plain_that_says_something_is_kept() -> None:
    table = {"text/plain": "   a\n0  1", "text/html": "<table><tr><td>1</td></tr></table>"}
    assert display_text(table) == "   a\n0  1"
    assert display_text({"text/plain": "<foo.Bar object at 0x1>"}) == "<foo.Bar object at 0x1>"
    assert display_text({"image/png": PNG}) is None
