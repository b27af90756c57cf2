"""Paths as the host resolved them: the host checks confinement, the guest only checks existence."""

import os

from .errors import GuestError


def existing_file(path):
    if not os.path.exists(path):
        raise GuestError(f"{path} does not exist")
    if not os.path.isfile(path):
        raise GuestError(f"{path} is not a file")
    return path


def output_file(path):
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return path


def page_numbers(pages, count):
    """'1-3,5' or [1, 2] (1-based) -> sorted 0-based indexes; all pages when None."""
    if pages is None:
        return list(range(count))
    if isinstance(pages, int):
        pages = [pages]
    if isinstance(pages, str):
        wanted: list[int] = []
        for part in pages.replace(" ", "").split(","):
            if not part:
                continue
            if "-" in part:
                start, _, end = part.partition("-")
                wanted.extend(range(int(start), int(end or count) + 1))
            else:
                wanted.append(int(part))
        pages = wanted
    indexes = []
    for page in pages:
        if not 1 <= int(page) <= count:
            raise GuestError(f"page {page} is out of range (the document has {count} pages)")
        indexes.append(int(page) - 1)
    return indexes
