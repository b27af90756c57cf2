"""pdf_ops, run inside the sandbox: untrusted PDFs are parsed only here (pypdf, pypdfium2)."""

import base64
import io
import os
from typing import Any

from .dispatch import run_op
from .errors import GuestError
from .paths import existing_file, output_file, page_numbers

OPS = ("info", "extract_text", "merge", "split", "rotate", "extract_pages", "to_images", "encrypt", "decrypt")
#: Rendering bounds: pixels per page, and previews returned inline.
MAX_RENDER_PIXELS = 25_000_000
PREVIEWS = 3
PREVIEW_SIZE = 800
TEXT_LIMIT = 200_000


def run(op, input_path, args=None):
    return run_op("pdf_ops", {name: globals()[f"_{name}"] for name in OPS}, op, input_path, args)


def _beside(path, suffix):
    """Default output next to the input: report.pdf -> report-SUFFIX."""
    return f"{os.path.splitext(path)[0]}-{suffix}"


def _reader(path, password=None):
    from pypdf import PdfReader

    reader = PdfReader(path)
    if reader.is_encrypted:
        if password is None:
            raise GuestError(f"{path} is encrypted: pass password (or use op 'decrypt')")
        if not reader.decrypt(password):
            raise GuestError(f"wrong password for {path}")
    return reader


def _write(writer, path):
    output_file(path)
    with open(path, "wb") as handle:
        writer.write(handle)
    return {"path": path, "pages": len(writer.pages), "bytes": os.path.getsize(path)}


def _info(path, password=None):
    from pypdf import PdfReader

    reader = PdfReader(path)
    encrypted = reader.is_encrypted
    info = {"path": path, "encrypted": encrypted, "bytes": os.path.getsize(path)}
    if encrypted and password is None:
        return info
    reader = _reader(path, password)
    meta = reader.metadata or {}
    info.update(pages=len(reader.pages), metadata={str(k).lstrip("/"): str(v) for k, v in meta.items()})
    return info


def _extract_text(path, pages=None, password=None):
    reader = _reader(path, password)
    texts, total = [], 0
    for index in page_numbers(pages, len(reader.pages)):
        text = reader.pages[index].extract_text() or ""
        texts.append({"page": index + 1, "text": text[: max(TEXT_LIMIT - total, 0)]})
        total += len(text)
    return {"path": path, "pages": texts, "truncated": total > TEXT_LIMIT}


def _merge(path, inputs, output=None, password=None):
    from pypdf import PdfWriter

    if isinstance(inputs, str) or not isinstance(inputs, list):
        raise GuestError('merge needs inputs as a list of PDF paths to append, e.g. ["b.pdf", "c.pdf"]')
    writer = PdfWriter()
    order = [path, *(existing_file(str(source)) for source in inputs)]
    for source in order:
        for page in _reader(source, password).pages:
            writer.add_page(page)
    # Said in the answer: input_path comes first, then inputs in their order.
    return {**_write(writer, output or _beside(path, "merged.pdf")), "merged_in_order": order}


def _split(path, ranges=None, output_prefix=None, password=None):
    """Without ranges: one file per page."""
    from pypdf import PdfWriter

    reader = _reader(path, password)
    if isinstance(ranges, str):  # '1-2,3-': one part each, as pages are written
        ranges = [part for part in ranges.replace(" ", "").split(",") if part]
    if not ranges:
        ranges = [str(number) for number in range(1, len(reader.pages) + 1)]
    if not isinstance(ranges, list):
        raise GuestError('split needs ranges as page ranges, e.g. "1-2,3-" (a file each)')
    output_prefix = output_prefix or _beside(path, "part")
    written = []
    for number, pages in enumerate(ranges, start=1):
        writer = PdfWriter()
        for index in page_numbers(pages, len(reader.pages)):
            writer.add_page(reader.pages[index])
        written.append(_write(writer, f"{output_prefix}-{number}.pdf"))
    return {"files": written}


def _rotate(path, degrees, output=None, pages=None, password=None):
    from pypdf import PdfWriter

    if not isinstance(degrees, int) or isinstance(degrees, bool) or degrees % 90:
        raise GuestError("degrees must be a multiple of 90")
    reader = _reader(path, password)
    chosen = set(page_numbers(pages, len(reader.pages)))
    writer = PdfWriter()
    for index, page in enumerate(reader.pages):
        writer.add_page(page)
        if index in chosen:
            writer.pages[-1].rotate(degrees)
    return _write(writer, output or _beside(path, "rotated.pdf"))


def _extract_pages(path, pages, output=None, password=None):
    from pypdf import PdfWriter

    reader = _reader(path, password)
    writer = PdfWriter()
    for index in page_numbers(pages, len(reader.pages)):
        writer.add_page(reader.pages[index])
    return _write(writer, output or _beside(path, "pages.pdf"))


def _to_images(path, output_prefix=None, pages=None, dpi=100, password=None):
    """PNG per page; by default next to the PDF: report.pdf -> report-page-1.png, ..."""
    import pypdfium2 as pdfium

    output_prefix = output_prefix or _beside(path, "page")
    document = pdfium.PdfDocument(path, password=password)
    try:
        scale = min(max(float(dpi), 10.0), 600.0) / 72
        files: list[dict[str, Any]] = []
        previews: list[str] = []
        for index in page_numbers(pages, len(document)):
            page = document[index]
            width, height = page.get_size()
            if width * height * scale * scale > MAX_RENDER_PIXELS:
                scale = (MAX_RENDER_PIXELS / (width * height)) ** 0.5
            image = page.render(scale=scale).to_pil()
            target = output_file(f"{output_prefix}-{index + 1}.png")
            image.save(target, "PNG")
            files.append({"page": index + 1, "path": target, "width": image.width, "height": image.height})
            if len(previews) < PREVIEWS:
                previews.append(_preview(image))
        return {"files": files, "previews": previews}
    finally:
        document.close()


def _encrypt(path, password, output=None, owner_password=None):
    from pypdf import PdfWriter

    if not isinstance(password, str) or not password:
        raise GuestError("encrypt needs password: a non-empty string")
    writer = PdfWriter(clone_from=_reader(path))
    writer.encrypt(user_password=password, owner_password=owner_password or password, algorithm="AES-256")
    return _write(writer, output or _beside(path, "encrypted.pdf"))


def _decrypt(path, password, output=None):
    from pypdf import PdfWriter

    return _write(PdfWriter(clone_from=_reader(path, password)), output or _beside(path, "decrypted.pdf"))


def _preview(image):
    image = image.copy()
    image.thumbnail((PREVIEW_SIZE, PREVIEW_SIZE))
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()
