"""Per-client bearer tokens: `coderunner token add NAME | list | revoke NAME`.

Each token is a client of its own (its own default session, sessions, exports and named
workspaces; see callers.py and owners.py). The server's first token (token_file, or
CODERUNNER_TOKEN) stays as it is and is the client `default`. Added tokens live in a 0700 folder
beside token_file, one 0600 file per client, named by the SHA-256 of its token and holding the
client's name: the secret is printed once by `token add` and kept nowhere, so a copy of the
folder lets nobody in.

The server looks a presented token up by its hash on every request (one small file opened by a
directory fd; nothing cached), so an added token works and a revoked one is refused from the
next request on, without a restart. Looking a hash up by name leaks nothing useful: whoever
does not hold a token cannot choose the hash they probe.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coderunner.errors import CodeRunnerError

log = logging.getLogger(__name__)

#: The client that the server's own token (token_file / CODERUNNER_TOKEN) is.
PRIMARY_CLIENT = "default"
#: What a client name may be: short, lower case, no dots (owners.py joins it with dots).
CLIENT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,23}")
RESERVED_NAMES = (PRIMARY_CLIENT, "local", "http")
TOKEN_BYTES = 32
#: Bounds on what the server reads from the folder.
MAX_CLIENTS = 1000
MAX_ENTRY_BYTES = 256
_HASH = re.compile(r"[0-9a-f]{64}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ClientTokenError(CodeRunnerError):
    """A token command that cannot be done; the message says what to do instead."""


def tokens_dir(token_file: Path) -> Path:
    """Where the per-client tokens live: beside the server's own token file."""
    return token_file.with_name("client-tokens")


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_name(name: str) -> str:
    if not CLIENT_NAME.fullmatch(name):
        raise ClientTokenError(f"client name {name!r}: use 1-24 lower-case letters, digits or '-', starting with one")
    if name in RESERVED_NAMES:
        raise ClientTokenError(f"{name!r} is reserved (the server's own token is the client {PRIMARY_CLIENT!r})")
    return name


def _open_dir(folder: Path, *, create: bool) -> int:
    """The folder by fd, refusing a link, another owner, or a mode others may enter."""
    if create:
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
    fd = os.open(folder, _DIR_FLAGS)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise ClientTokenError(
            f"{folder} must be a folder of yours that only you may enter: chown it to you and chmod 700 {folder}"
        )
    return fd


@contextlib.contextmanager
def _locked_dir(folder: Path, *, create: bool) -> Iterator[int]:
    """The folder's fd, held under an exclusive lock: two token commands never interleave."""
    try:
        fd = _open_dir(folder, create=create)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ClientTokenError(f"cannot use the token folder {folder}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def new_token(size: int) -> str:
    """A fresh token of `size` random bytes that never begins with '-': given on a command line
    (`coderunner proxy URL --token TOKEN`, a client's args) it would be read as an option."""
    while (token := secrets.token_urlsafe(size)).startswith("-"):
        pass
    return token


def add(folder: Path, name: str) -> str:
    """Make a token for a new client `name`; returns it (only its hash is stored)."""
    check_name(name)
    token = new_token(TOKEN_BYTES)
    with _locked_dir(folder, create=True) as dir_fd:
        if name in _entries(dir_fd).values():
            raise ClientTokenError(
                f"there is already a client {name!r}: `coderunner token revoke {name}` first to replace its token"
            )
        try:
            fd = os.open(digest(token), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)  # fmt: skip
            with os.fdopen(fd, "w") as handle:
                handle.write(name + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            raise ClientTokenError(f"cannot write the token of {name!r} in {folder}: {exc.strerror}") from None
    return token


def revoke(folder: Path, name: str) -> None:
    """Forget client `name`'s token: a running server refuses it from its next request on."""
    missing = ClientTokenError(f"there is no client {name!r}: `coderunner token list` shows them")
    try:
        with _locked_dir(folder, create=False) as dir_fd:
            hashes = [hashed for hashed, owner in _entries(dir_fd).items() if owner == name]
            if not hashes:
                raise missing
            for hashed in hashes:
                os.unlink(hashed, dir_fd=dir_fd)
    except FileNotFoundError:
        raise missing from None


def names(folder: Path) -> list[str]:
    """The clients with a token in `folder`, sorted (never their secrets: only hashes are kept)."""
    try:
        with _locked_dir(folder, create=False) as dir_fd:
            return sorted(set(_entries(dir_fd).values()))
    except FileNotFoundError:
        return []


def check_folder(folder: Path) -> None:
    """Raise ClientTokenError when the folder exists but is unsafe (at server start: said at once)."""
    with contextlib.suppress(FileNotFoundError):
        os.close(_open_dir(folder, create=False))


def lookup(folder: Path, token: str) -> str | None:
    """The client whose token this is, or None (also for an unsafe folder: fail closed)."""
    try:
        dir_fd = _open_dir(folder, create=False)
    except (OSError, ClientTokenError):
        return None
    try:
        return _read_entry(dir_fd, digest(token))
    finally:
        os.close(dir_fd)


def _entries(dir_fd: int) -> dict[str, str]:
    """token hash -> client name, for the well-formed entries (bounded)."""
    found: dict[str, str] = {}
    for entry in os.listdir(dir_fd):
        if len(found) >= MAX_CLIENTS:
            log.warning("more than %d client tokens; the rest are ignored", MAX_CLIENTS)
            break
        if _HASH.fullmatch(entry) and (name := _read_entry(dir_fd, entry)) is not None:
            found[entry] = name
    return found


def _read_entry(dir_fd: int, entry: str) -> str | None:
    """The client name in one entry, or None for anything but a regular file of ours holding one."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        name = os.read(fd, MAX_ENTRY_BYTES).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return name if CLIENT_NAME.fullmatch(name) and name not in RESERVED_NAMES else None


@dataclass(frozen=True)
class ClientTokens:
    """The server's view of the token folder: every lookup reads it afresh (revocation is immediate)."""

    folder: Path

    def check(self) -> None:
        check_folder(self.folder)

    def match(self, presented: str) -> str | None:
        return lookup(self.folder, presented)
