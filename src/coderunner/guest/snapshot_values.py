"""What a snapshot says about the user's values: which names are the user's, which values hold
something live (left out unpickled), and short plain reasons for what could not be saved or loaded.
Never a value's repr. Runs inside the sandbox, as coderunner_guest.
"""

import errno
import io
import os
import re
import sys
import threading
import types

from .snapshot_pickling import measure

#: IPython's own names, kept out even when the shell does not list them as hidden.
IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})
GUEST_PACKAGE = "coderunner_guest"
#: "cannot pickle 'X' object" in a pickling error names the part that failed; the kind it is.
UNPICKLABLE_PART = re.compile(r"cannot pickle '([^']{1,200})' object")
PART_KINDS = (
    (("TextIOWrapper", "BufferedReader", "BufferedWriter", "BufferedRandom", "FileIO", "mmap"), "open file handle"),
    (("socket", "SSLSocket", "SSLContext"), "socket"),
    (("_thread.lock", "_thread.RLock", "Lock", "RLock"), "lock"),
    (("generator", "coroutine", "async_generator", "frame"), "generator or coroutine"),
    (("sqlite3.Connection", "sqlite3.Cursor", "Connection", "Cursor"), "database connection"),
    (("_asyncio.Task", "_asyncio.Future"), "running task"),
)
DATABASE_PACKAGES = frozenset({"sqlite3", "psycopg", "psycopg2", "pymysql", "MySQLdb", "duckdb", "sqlalchemy"})


def user_names(ipython, namespace):
    """The user's names, as IPython's %who sees them: no _names, none of IPython's own."""
    hidden = getattr(ipython, "user_ns_hidden", {})
    missing = object()
    names = []
    for name in list(namespace):
        if not isinstance(name, str) or name.startswith("_") or name in IPYTHON_NAMES:
            continue
        if namespace[name] is hidden.get(name, missing):
            continue  # IPython's own (a hidden name the user rebound is the user's)
        if not name.isidentifier():
            continue  # only reachable through globals()[...]; not a name a cell can use
        names.append(name)
    return names


def ipython_names(ipython, namespace):
    """The names bound to IPython's own objects (get_ipython, In, Out, ...)."""
    hidden = getattr(ipython, "user_ns_hidden", {})
    own = {name for name in IPYTHON_NAMES if name in namespace}
    own.update(name for name, value in list(hidden.items()) if isinstance(name, str) and namespace.get(name) is value)
    return own


def too_large(limit, saved, rest, context):
    sizes = [(item["bytes"], item["name"]) for item in saved]
    for name in rest:
        value = context.namespace.get(name)
        if isinstance(value, types.ModuleType) or of_the_guest(value) or live_resource(value) is not None:
            continue
        size = measure(value, context)
        if size is not None:
            sizes.append((size, name))
    sizes.sort(reverse=True)
    biggest = ", ".join(f"{name} ({human(size)})" for size, name in sizes[:5])
    total = sum(size for size, _ in sizes)
    return (
        f"the kernel state is larger than the snapshot limit ({human(limit)}; about {human(total)} in all): "
        f"biggest variables: {biggest or 'none'}; del what is not needed, or ask the user to raise snapshot_limit_mb"
    )


def write_failure(error):
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            "the kernel state does not fit in the session's disk (it is written there before the snapshot takes it): "
            "del big variables or remove files, then try again"
        )
    reason = os.strerror(error.errno) if error.errno else "a write failed"
    return f"the kernel state could not be written: {reason}"


def human(size):
    if size >= 1024 * 1024:
        return f"{size / (1024 * 1024):.0f} MiB"
    if size >= 1024:
        return f"{size / 1024:.0f} KiB"
    return f"{size} bytes"


def type_name(value):
    return type(value).__qualname__


def class_module(value):
    module = getattr(type(value), "__module__", None)
    return module if isinstance(module, str) else ""


def of_the_guest(value):
    """Whether `value` is CodeRunner's own (a guest module, or its functions, classes, objects)."""
    module: object
    if isinstance(value, types.ModuleType):
        module = value.__name__
    elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        module = getattr(value, "__module__", None)
    else:
        module = getattr(type(value), "__module__", None)
    return isinstance(module, str) and (module == GUEST_PACKAGE or module.startswith(GUEST_PACKAGE + "."))


def live_resource(value):
    """A plain name for a value that holds something live (a thread, a file...), or None.

    These are left out without trying to pickle them: their running state cannot travel, and
    pickling some of them (a Playwright page) would walk the whole browser connection.
    """
    if isinstance(value, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        return "a generator or coroutine"
    if isinstance(value, threading.Thread):
        return "a thread"
    if isinstance(value, LOCK_TYPES):
        return "a lock"
    if isinstance(value, io.IOBase) and not isinstance(value, (io.BytesIO, io.StringIO)):
        return "an open file handle"
    modules = sys.modules
    socket = modules.get("socket")
    if socket is not None and isinstance(value, socket.socket):
        return "a socket"
    subprocess = modules.get("subprocess")
    if subprocess is not None and isinstance(value, subprocess.Popen):
        return "a subprocess"
    asyncio = modules.get("asyncio")
    if asyncio is not None:
        if isinstance(value, asyncio.subprocess.Process):
            return "a subprocess"
        if isinstance(value, asyncio.Future):
            return "a running task"
        if isinstance(value, asyncio.AbstractEventLoop):
            return "an event loop"
    mmap = modules.get("mmap")
    if mmap is not None and isinstance(value, mmap.mmap):
        return "an open file handle"
    module = getattr(type(value), "__module__", None)
    package = module.split(".")[0] if isinstance(module, str) else ""
    if package == "playwright":
        return "a browser page or Playwright object"
    if package in ("IPython", "ipykernel") and type(value).__qualname__.endswith("Shell"):
        return "the IPython shell (get_ipython() gives it again)"
    if package in DATABASE_PACKAGES:
        kind = type(value).__qualname__.lower()
        if "connection" in kind or "cursor" in kind or "engine" in kind or "session" in kind:
            return "a database connection"
    return None


LOCK_TYPES = (
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Condition,
    threading.Semaphore,
    threading.Event,
    threading.Barrier,
)


def pickling_failure(exc):
    """A short plain reason for a value that failed to pickle (never its repr or the full text)."""
    match = UNPICKLABLE_PART.search(str(exc)[:2000])
    if match:
        part = match.group(1)
        for names, kind in PART_KINDS:
            if part in names or part.split(".")[-1] in names:
                return f"holds a {kind}" if not kind.startswith("open") else f"holds an {kind}"
    return f"cannot be pickled: {type(exc).__name__}"


def import_failure(module, exc):
    if isinstance(exc, ModuleNotFoundError):
        return f"its module {module!r} is not importable here"
    return f"its module {module!r} failed to import: {type(exc).__name__}"


def loading_failure(exc, python):
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if python != here and not isinstance(exc, (ModuleNotFoundError, MemoryError, FileNotFoundError)):
        return f"it was saved by Python {python[:20]} and this kernel runs Python {here}"
    if isinstance(exc, ModuleNotFoundError) and isinstance(exc.name, str) and len(exc.name) < 200:
        return f"its module {exc.name!r} is not importable here"
    if isinstance(exc, AttributeError) and "Can't get attribute" in str(exc)[:500]:
        return "its class or function is no longer defined in its module"
    if isinstance(exc, MemoryError):
        return "not enough memory to load it"
    if isinstance(exc, FileNotFoundError):
        return "its file is missing from the snapshot"
    return f"could not be loaded: {type(exc).__name__}"
