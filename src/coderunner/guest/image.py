"""image_ops, run inside the sandbox: untrusted images are decoded only here (Pillow, Tesseract)."""

import base64
import io
import os
import warnings

from .dispatch import run_op
from .errors import GuestError
from .paths import output_file

OPS = ("info", "resize", "thumbnail", "crop", "rotate", "flip", "convert", "grayscale", "ocr")
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP", "tiff": "TIFF"}
#: Decompression-bomb guard: more pixels than this is refused before decoding.
MAX_PIXELS = 40_000_000
MAX_SIDE = 20_000
PREVIEW_SIZE = 512


def run(op, input_path, args=None):
    return run_op("image_ops", {name: globals()[f"_{name}"] for name in OPS}, op, input_path, args)


def _open(path):
    from PIL import Image, UnidentifiedImageError

    Image.MAX_IMAGE_PIXELS = MAX_PIXELS
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    try:
        image = Image.open(path)
    except UnidentifiedImageError:
        raise GuestError(f"{path} is not an image Pillow can read") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise GuestError(f"{path} is too large to decode safely (over {MAX_PIXELS:,} pixels)") from None
    width, height = image.size
    if width * height > MAX_PIXELS or max(width, height) > MAX_SIDE:
        raise GuestError(f"{path} is {width}x{height}: too large to decode safely (limit {MAX_PIXELS:,} pixels)")
    image.load()
    return image


def _default_output(path, op, extension=None):
    stem, ext = os.path.splitext(path)
    return f"{stem}-{op}{'.' + extension if extension else ext or '.png'}"


def _save(image, output, fmt=None):
    output_file(output)
    fmt = fmt or FORMATS.get(os.path.splitext(output)[1].lstrip(".").lower(), "PNG")
    if fmt == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    image.save(output, fmt)
    return {
        "path": output,
        "width": image.width,
        "height": image.height,
        "format": fmt,
        "bytes": os.path.getsize(output),
        "preview": _preview(image),
    }


def _preview(image):
    image = image.copy()
    image.thumbnail((PREVIEW_SIZE, PREVIEW_SIZE))
    buffer = io.BytesIO()
    image.convert("RGBA" if image.mode in ("RGBA", "LA", "P") else "RGB").save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _info(path):
    image = _open(path)
    return {
        "path": path,
        "width": image.width,
        "height": image.height,
        "mode": image.mode,
        "format": image.format,
        "bytes": os.path.getsize(path),
    }  # metadata only: a preview is for what an op made (read_file shows the image itself)


def _resize(path, width=None, height=None, output=None, keep_aspect=True):
    image = _open(path)
    if not width and not height:
        raise GuestError("resize needs width and/or height")
    if keep_aspect:
        ratio = min((width or 10**9) / image.width, (height or 10**9) / image.height)
        size = (max(1, round(image.width * ratio)), max(1, round(image.height * ratio)))
    else:
        size = (int(width or image.width), int(height or image.height))
    if size[0] * size[1] > MAX_PIXELS:
        raise GuestError(f"{size[0]}x{size[1]} is too large (limit {MAX_PIXELS:,} pixels)")
    return _save(image.resize(size), output or _default_output(path, "resized"))


def _thumbnail(path, size=256, output=None):
    image = _open(path)
    image.thumbnail((int(size), int(size)))
    return _save(image, output or _default_output(path, "thumb"))


def _crop(path, box, output=None):
    if (
        not isinstance(box, list)
        or len(box) != 4
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in box)
    ):
        raise GuestError("crop needs box as four whole numbers [left, top, right, bottom], in pixels")
    left, top, right, bottom = box
    image = _open(path)
    if not (0 <= left < right <= image.width and 0 <= top < bottom <= image.height):
        raise GuestError(
            f"crop box ({left}, {top}, {right}, {bottom}) is outside the {image.width}x{image.height} image"
        )
    return _save(image.crop((left, top, right, bottom)), output or _default_output(path, "crop"))


def _rotate(path, degrees, output=None, expand=True):
    image = _open(path)
    return _save(image.rotate(-float(degrees), expand=bool(expand)), output or _default_output(path, "rotated"))


def _flip(path, direction="horizontal", output=None):
    from PIL import Image

    image = _open(path)
    if direction not in ("horizontal", "vertical"):
        raise GuestError("direction must be 'horizontal' or 'vertical'")
    method = Image.Transpose.FLIP_LEFT_RIGHT if direction == "horizontal" else Image.Transpose.FLIP_TOP_BOTTOM
    return _save(image.transpose(method), output or _default_output(path, "flipped"))


def _convert(path, format="png", output=None):
    name = str(format).lower()
    if name not in FORMATS:
        raise GuestError(f"unknown format {format!r}; use one of {', '.join(sorted(FORMATS))}")
    image = _open(path)
    return _save(image, output or _default_output(path, "converted", "jpg" if name == "jpeg" else name), FORMATS[name])


def _grayscale(path, output=None):
    return _save(_open(path).convert("L"), output or _default_output(path, "gray"))


def _ocr(path, lang="eng"):
    import pytesseract

    image = _open(path)
    try:
        text = pytesseract.image_to_string(image, lang=lang, timeout=60)
    except pytesseract.TesseractNotFoundError:
        raise GuestError("Tesseract is not installed in the sandbox (apt-get install tesseract-ocr)") from None
    except RuntimeError as exc:
        installed = _ocr_languages(pytesseract.pytesseract.tesseract_cmd)
        missing = [part for part in str(lang).split("+") if installed is not None and part not in installed]
        if missing:  # Tesseract's own text here is about TESSDATA_PREFIX, which the caller cannot set
            raise GuestError(
                f"no OCR language {'+'.join(missing)!r} in the sandbox; installed: {', '.join(installed) or 'none'} "
                "(join several with '+'; more: the user installs tesseract-ocr-LANG)"
            ) from None
        raise GuestError(f"OCR failed: {exc}") from None
    return {"path": path, "text": text, "lang": lang}


def _ocr_languages(command):
    """The languages Tesseract has data for, or None when it cannot say within a few seconds."""
    import subprocess

    try:
        listed = subprocess.run([command, "--list-langs"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (listed.stdout + listed.stderr).splitlines()
    return sorted({line.strip() for line in lines if line.strip() and " " not in line.strip() and ":" not in line})
