"""Host folders files may come from (import_dirs) and go to (the client's export folder), nothing else.

A host path is matched to its folder lexically, then walked through a SandboxFiles view rooted
at that folder, so a symlink inside it (the export folder is writable by sandboxed code) can
never lead the host outside.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from coderunner.hostfs.exports import client_folder, folder_owner, open_target, prepare_export_dir
from coderunner.hostfs.sandbox_files import FileAccessError, SandboxFiles
from coderunner.vocabulary.mounts import Mount

IMPORT_ROOT = "/import"
EXPORT_ROOT = "/export"


@dataclass(frozen=True)
class HostFolder:
    """A host folder seen through a symlink-safe view, and a path inside it."""

    view: SandboxFiles
    path: str
    root: Path

    def host_path(self, view_path: str) -> Path:
        base = EXPORT_ROOT if view_path.startswith(EXPORT_ROOT) else IMPORT_ROOT
        return self.root / view_path[len(base) :].lstrip("/")

    def in_host_words(self, refused: FileAccessError) -> FileAccessError:
        """A refusal about this file as the user knows it: its host path, never the view's /export/... name."""
        base = EXPORT_ROOT if self.path.startswith(EXPORT_ROOT) else IMPORT_ROOT
        folder = str(self.root)
        return FileAccessError(re.sub(rf"(?<!\S){base}(?=/|[\s:;,)]|$)", lambda _: folder, str(refused)))


def _inside(path: Path, roots: list[Path], what: str) -> tuple[Path, str]:
    for root in roots:
        if path == root or root in path.parents:
            return root, path.relative_to(root).as_posix()
    listed = ", ".join(str(root) for root in roots) or f"none are configured ({what})"
    raise FileAccessError(f"{path} is outside the folders allowed for this: {listed}")


def _absolute(host_path: str, base: Path | None = None) -> Path:
    path = Path(host_path).expanduser()
    if not path.is_absolute():
        if base is None:
            raise FileAccessError(f"{host_path} must be an absolute host path")
        path = base / path
    return Path(os.path.abspath(path))


def import_source(import_dirs: list[Path], host_path: str) -> HostFolder:
    """A file in an import folder; a relative path starts in the only one (with several: refused, naming them)."""
    roots = [root.expanduser().resolve() for root in import_dirs]
    if not roots:
        raise FileAccessError("no import folder is configured (import_dirs), so nothing can be uploaded")
    if len(roots) > 1 and not Path(host_path).expanduser().is_absolute():
        listed = ", ".join(str(root) for root in roots)
        raise FileAccessError(f"{host_path} is relative and there are several import folders: give its full path "
                              f"in one of {listed}")  # fmt: skip
    root, relative = _inside(_absolute(host_path, roots[0]), roots, "import_dirs")
    view = SandboxFiles([Mount(root, IMPORT_ROOT, writable=False)])
    return HostFolder(view, posixpath.join(IMPORT_ROOT, relative), root)


def export_target(export_dir: Path | None, client: str, host_path: str | None, default_name: str,
                  sandbox_uid: int | None = None) -> HostFolder:  # fmt: skip
    """A file in `client`'s own export folder (export_dir/<client>/); relative paths start there."""
    if export_dir is None:
        raise FileAccessError("no export folder is configured (export_dir), so nothing can be downloaded")
    top = prepare_export_dir(export_dir)
    owner = folder_owner(top, sandbox_uid)
    root = client_folder(top, client)
    os.close(open_target(root, owner))
    root, relative = _inside(_absolute(host_path or default_name, base=root), [root], "export_dir")
    if not relative or relative == ".":
        raise FileAccessError(f"{host_path} is the export folder itself: name a file inside it")
    view = SandboxFiles([Mount(root, EXPORT_ROOT, writable=True)], owner=owner)
    return HostFolder(view, posixpath.join(EXPORT_ROOT, relative), root)
