"""sandbox:// reads: MIME type from the bytes (images) or the name, text as text (resource_contents)."""

from __future__ import annotations

import pytest

from coderunner.tools.file_results import resource_contents

PNG = b"\x89PNG\r\n\x1a\n" + bytes(32)


@pytest.mark.parametrize(
    ("path", "data", "expected"),
    [
        ("table.csv", b"x,y\n1,2\n", ("x,y\n1,2\n", "text/csv")),
        ("notes", "héllo".encode(), ("héllo", "text/plain")),
        ("data.json", b"{}", ("{}", "application/json")),
        ("plot.svg", b"<svg/>", ("<svg/>", "image/svg+xml")),
        ("chart.png", PNG, (PNG, "image/png")),
        ("renamed.txt", PNG, (PNG, "image/png")),  # the bytes decide for images, not the name
        ("fake.png", b"just text", ("just text", "text/plain")),  # text named like an image is text
        ("blob.bin", bytes(range(256)), (bytes(range(256)), "application/octet-stream")),
        ("latin1.txt", b"caf\xe9 ok", (b"caf\xe9 ok", "application/octet-stream")),  # not UTF-8: bytes
        ("empty", b"", ("", "text/plain")),
    ],
)
def test_resource_contents(path: str, data: bytes, expected: tuple[str | bytes, str]) -> None:
    assert resource_contents(path, data) == expected


def test_text_that_turns_binary_after_the_sniffed_head_is_served_as_bytes() -> None:
    data = b"a" * 10_000 + b"\xff\xfe"
    assert resource_contents("log.txt", data) == (data, "application/octet-stream")
