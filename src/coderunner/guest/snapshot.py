"""A kernel's state saved to files and loaded back, inside the sandbox (never on the host).

The host calls `run(op="save", dir=..., limit_bytes=...)` in the session's kernel; it writes the
user's namespace into `dir` as manifest.json plus one pickle per variable (v-0001.pkl, ...), made
with cloudpickle so that functions and classes defined in cells travel by value. Imported modules
are recorded by name and imported again at load. A variable that cannot be pickled is left out and
named with the reason. The host moves the folder into its store; at restore it puts a copy in the
new sandbox's read-only host dir, and `run(op="load", dir=...)` loads it into the fresh kernel.

Save returns:
    {"saved": [{"name", "type", "bytes"}], "modules": [{"name", "module"}],
     "skipped": [{"name", "type", "reason"}], "bytes": total, "not_carried": [what never travels],
     "cwd": the kernel's working directory}
Load returns:
    {"restored": [names], "modules": [names], "failed": [{"name", "reason"}], "not_carried": [...],
     "skipped": [{"name", "type", "reason"}] (what the save left out, from its manifest)}

Loading unpickles only what the save wrote from this user's own objects; each variable is loaded
on its own, so one that fails (its class's module is gone, say) is named and the others come back.
The price of one pickle per variable: two names for one object (`b = a`, or `a` also held in a
list) come back as two equal copies, not one shared object. Classes defined in cells stay one
class (cloudpickle tracks them), so `isinstance(p, Point)` still holds.

What loading runs: unpickling calls the reconstructors the pickle names. For a snapshot this
module wrote, those are the user's own classes (their `__setstate__`, `__reduce__` results),
functions and classes rebuilt by value from code the user ran in cells, and the modules the
user's objects came from (imported, as the user's own `import` did). A pickle someone planted in
the workspace could name anything, and it would run as the user's code does: inside this sandbox
only, with nothing more than the sandbox allows. The host never unpickles. A planted
`sitecustomize` or `.pth` in the workspace is the host's concern (it disables start-up files of a
reopened workspace); this module imports only the module names the manifest lists.

Functions defined in cells keep the kernel's namespace as their globals after a load (not a
private copy), so a restored function sees the user's later assignments, as it did before: their
globals are pickled as a reference to "the kernel's namespace", and the globals they use that are
variables of their own (or IPython's, like get_ipython) are not copied into their pickle; they
come back on their own. So `def f(): return df.sum()` does not carry a second copy of df.

Memory: pickles are written straight to their files (protocol 5, so a numpy array's buffer goes
to the file without a copy) and read straight back, so saving or loading a large array needs
about its own size, not twice that.
"""

import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import sys
import threading
import types

from .dispatch import GuestError

MANIFEST = "manifest.json"
FORMAT = "coderunner-kernel-state"
VERSION = 1
PROTOCOL = 5
#: The manifest is small (names and types); a larger one is not ours.
MANIFEST_LIMIT = 16 * 1024 * 1024
#: IPython's own names, kept out even when the shell does not list them as hidden.
IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})
GUEST_PACKAGE = "coderunner_guest"
#: What never travels in a snapshot, in plain words (every reply lists it).
NOT_CARRIED = [
    "running threads and tasks",
    "open files and sockets",
    "subprocesses and database connections",
    "the browser page",
    "the kernel's history (In/Out) and names starting with _",
]
FILE_PATTERN = re.compile(r"v-[0-9]{4,7}\.pkl")
MODULE_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
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


def run(op, dir, limit_bytes=None):
    if not isinstance(dir, str) or not dir:
        raise GuestError("snapshot: dir must be a folder path")
    if op == "save":
        if limit_bytes is not None and (type(limit_bytes) is not int or limit_bytes <= 0):
            raise GuestError("snapshot save: limit_bytes must be a positive number of bytes")
        return save(dir, limit_bytes)
    if op == "load":
        return load(dir)
    if op == "discard":
        return discard(dir)
    raise GuestError(f"unknown snapshot op {op!r}; valid ops: save, load, discard")


def discard(dir):
    """Remove a saved state folder once the host has copied it. Done from inside: under gVisor a
    file the host deletes stays allocated while the sandbox's kernel still caches it, so a state
    removed only by the host kept its whole size in the workspace until the sandbox ended."""
    if os.path.islink(dir):
        os.unlink(dir)
    else:
        shutil.rmtree(dir, ignore_errors=True)
    return {"removed": not os.path.lexists(dir)}


# --- save -----------------------------------------------------------------------------------


class TooLarge(Exception):
    """The state passed the limit while a pickle was being written."""


class WriteFailed(Exception):
    """The snapshot folder could not be written (disk full, quota): the whole save stops."""

    def __init__(self, error):
        super().__init__(error)
        self.error = error


class CountingWriter:
    """A file-like sink for the pickler: counts bytes and refuses to pass the limit.

    Writes go to `file`, an unbuffered file (or nowhere, to measure); large buffers (a numpy
    array's memory) are passed through as they are, never copied. A write error is WriteFailed,
    so it is told apart from a value that cannot be pickled.
    """

    def __init__(self, file, used=0, limit=None):
        self.file = file
        self.used = used
        self.limit = limit
        self.written = 0

    def write(self, data):
        view = data.raw() if isinstance(data, pickle.PickleBuffer) else memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        size = len(view)
        if self.limit is not None and self.used + self.written + size > self.limit:
            raise TooLarge
        if self.file is not None:
            try:
                while view:  # an unbuffered write may take only part
                    view = view[self.file.write(view) :]
            except OSError as exc:
                raise WriteFailed(exc) from None
        self.written += size
        return size


def shell():
    from IPython import get_ipython

    ipython = get_ipython()
    if ipython is None:
        raise GuestError("snapshot runs only inside the session's kernel")
    return ipython


def save(dir, limit_bytes):
    ipython = shell()
    namespace = ipython.user_ns
    try:
        remove(dir)
        os.makedirs(dir)
    except OSError as exc:
        raise GuestError(write_failure(exc)) from None
    try:
        return write_state(ipython, namespace, dir, limit_bytes)
    except BaseException:
        remove(dir)  # an interrupted or refused save leaves nothing half-written behind
        raise


def write_state(ipython, namespace, dir, limit_bytes):
    try:
        pickler_class()
    except ImportError:
        raise GuestError("snapshots need cloudpickle in the sandbox environment; run `coderunner setup`") from None
    saved, modules, skipped, entries = [], [], [], []
    total = 0
    names = user_names(ipython, namespace)
    context = Context(namespace, set(names) | ipython_names(ipython, namespace))
    for index, name in enumerate(names):
        value = namespace[name]
        kind = type_name(value)
        if of_the_guest(value):
            skipped.append({"name": name, "type": kind, "reason": "part of CodeRunner itself (import it again)"})
            continue
        if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value:
            modules.append({"name": name, "module": value.__name__})
            continue
        reason = live_resource(value)
        if reason is not None:
            skipped.append({"name": name, "type": kind, "reason": reason})
            continue
        file_name = f"v-{len(entries) + 1:04d}.pkl"
        path = os.path.join(dir, file_name)
        try:
            size = dump(value, path, context, total, limit_bytes)
        except TooLarge:
            raise GuestError(too_large(limit_bytes, saved, names[index:], context)) from None
        except WriteFailed as failed:
            raise GuestError(write_failure(failed.error)) from None
        except Exception as exc:  # anything the value's own reducers raise: named, and the rest go on
            skipped.append({"name": name, "type": kind, "reason": pickling_failure(exc)})
            continue
        total += size
        saved.append({"name": name, "type": kind, "bytes": size})
        entries.append({"name": name, "file": file_name, "type": kind, "class_module": class_module(value)})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "cwd": os.getcwd(),
        "variables": entries,
        "modules": modules,
        "skipped": skipped,
        "not_carried": NOT_CARRIED,
    }
    data = json.dumps(manifest, indent=1).encode()
    if limit_bytes is not None and total + len(data) > limit_bytes:
        raise GuestError(too_large(limit_bytes, saved, [], context))
    try:
        with open(os.path.join(dir, MANIFEST), "wb") as file:
            file.write(data)
    except OSError as exc:
        raise GuestError(write_failure(exc)) from None
    total += len(data)
    return {
        "saved": saved,
        "modules": modules,
        "skipped": skipped,
        "bytes": total,
        "not_carried": NOT_CARRIED,
        "cwd": manifest["cwd"],
    }


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


class NamespaceMarker(dict):
    """Stands for the kernel's namespace as the globals of cell-defined functions in a pickle."""

    def __reduce__(self):
        return kernel_namespace, ()


def kernel_namespace():
    """At load: the namespace of the kernel loading the pickle (a restored function's globals)."""
    return shell().user_ns


class Context:
    """What the pickles of one save share."""

    def __init__(self, namespace, separate):
        self.namespace = namespace
        #: Names that come back on their own (the user's variables, IPython's objects): not copied
        #: into the pickle of a function that uses them.
        self.separate = frozenset(separate)
        self.marker = NamespaceMarker()


def make_pickler(file, context):
    pickler = pickler_class()(file, protocol=PROTOCOL)
    pickler.context = context
    # Functions whose globals are the kernel's namespace get the marker as their globals in the
    # pickle; it is loaded as the namespace of the kernel that loads it.
    pickler.globals_ref[id(context.namespace)] = context.marker
    return pickler


def refuse_open_file(file):
    """cloudpickle would pickle a text file opened for reading as a copy of its whole content:
    a surprise (and unbounded); an open file held inside a container is refused like one alone."""
    raise TypeError("cannot pickle 'TextIOWrapper' object")


PICKLER = []


def pickler_class():
    """cloudpickle's Pickler, with cell functions' globals as a reference to the kernel's namespace."""
    if not PICKLER:
        from collections import ChainMap
        from typing import ClassVar

        import cloudpickle

        class Pickler(cloudpickle.Pickler):
            dispatch_table: ClassVar = ChainMap(
                {io.TextIOWrapper: refuse_open_file}, cloudpickle.Pickler.dispatch_table
            )

            def _dynamic_function_reduce(self, func):
                reduced = super()._dynamic_function_reduce(func)
                if func.__globals__ is self.context.namespace:
                    _, slotstate = reduced[2]
                    used = slotstate["__globals__"]
                    separate = self.context.separate
                    slotstate["__globals__"] = {name: used[name] for name in used if name not in separate}
                return reduced

        PICKLER.append(Pickler)
    return PICKLER[0]


def dump(value, path, context, used, limit):
    """Pickle `value` into a new file at `path`; its size. A failure leaves no file."""
    try:
        file = open(path, "xb", buffering=0)  # noqa: SIM115 (closed below; unbuffered: write errors surface in write)
    except OSError as exc:
        raise WriteFailed(exc) from None
    try:
        with file:
            sink = CountingWriter(file, used, limit)
            make_pickler(sink, context).dump(value)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return sink.written


def measure(value, context):
    """How many bytes `value` pickles to (by pickling it to nowhere), or None if it cannot be."""
    sink = CountingWriter(None)
    try:
        make_pickler(sink, context).dump(value)
    except Exception:
        return None
    return sink.written


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


# --- load -----------------------------------------------------------------------------------


def load(dir):
    ipython = shell()
    namespace = ipython.user_ns
    manifest = read_manifest(dir)
    cwd = manifest["cwd"]
    if os.path.isdir(cwd):
        os.chdir(cwd)
    restored, modules, failed = [], [], []
    for item in manifest["modules"]:
        try:
            namespace[item["name"]] = import_module(item["module"])
        except Exception as exc:
            failed.append({"name": item["name"], "reason": import_failure(item["module"], exc)})
            continue
        modules.append(item["name"])
    builtins = namespace.get("__builtins__")
    try:
        for item in manifest["variables"]:
            try:
                value = unpickle(os.path.join(dir, item["file"]))
            except Exception as exc:  # the user's own reconstructors: any error names the variable
                failed.append({"name": item["name"], "reason": loading_failure(exc, manifest["python"])})
                continue
            namespace[item["name"]] = value
            restored.append(item["name"])
    finally:
        # cloudpickle sets a restored function's globals' __builtins__ to its own module's; put back the kernel's
        if builtins is not None:
            namespace["__builtins__"] = builtins
    return {
        "restored": restored,
        "modules": modules,
        "failed": failed,
        "not_carried": NOT_CARRIED,
        "skipped": saved_skipped(manifest),
    }


def saved_skipped(manifest):
    """What the save left out (named with its reason), so a restore can say it did not come back."""
    skipped = manifest.get("skipped")
    out = []
    for item in skipped if isinstance(skipped, list) else []:
        if isinstance(item, dict) and all(isinstance(item.get(key), str) for key in ("name", "type", "reason")):
            out.append({key: item[key][:200] for key in ("name", "type", "reason")})
    return out[:10_000]


def import_module(name):
    import importlib

    return importlib.import_module(name)


def unpickle(path):
    with open(path, "rb") as file:
        return pickle.load(file)


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


def read_manifest(dir):
    """manifest.json from `dir`, checked to be what save writes (else GuestError)."""
    path = os.path.join(dir, MANIFEST)
    try:
        with open(path, "rb") as file:
            data = file.read(MANIFEST_LIMIT + 1)
    except FileNotFoundError:
        raise GuestError(f"no snapshot in {dir}: {MANIFEST} is missing") from None
    except OSError as exc:
        raise GuestError(f"the snapshot's {MANIFEST} cannot be read: {os.strerror(exc.errno or 0)}") from None
    if len(data) > MANIFEST_LIMIT:
        raise GuestError(f"the snapshot's {MANIFEST} is too large to be one this kernel wrote")
    try:
        manifest = json.loads(data)
    except ValueError:
        raise GuestError(f"the snapshot's {MANIFEST} is not valid JSON") from None
    problem = manifest_problem(manifest)
    if problem:
        raise GuestError(f"the snapshot's {MANIFEST} is not one CodeRunner wrote: {problem}")
    return manifest


def manifest_problem(manifest):
    if not isinstance(manifest, dict):
        return "not an object"
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        return f"format is not {FORMAT} version {VERSION}"
    if not isinstance(manifest.get("cwd"), str) or not isinstance(manifest.get("python"), str):
        return "cwd or python is missing"
    variables, modules = manifest.get("variables"), manifest.get("modules")
    if not isinstance(variables, list) or not isinstance(modules, list):
        return "variables or modules is not a list"
    names, files = set(), set()
    for item in variables:
        if not isinstance(item, dict) or not good_name(item.get("name")):
            return "a variable has no valid name"
        file = item.get("file")
        if not isinstance(file, str) or not FILE_PATTERN.fullmatch(file) or file in files:
            return f"variable {item['name']} has no valid file"
        if item["name"] in names:
            return f"variable {item['name']} appears twice"
        names.add(item["name"])
        files.add(file)
    for item in modules:
        if not isinstance(item, dict) or not good_name(item.get("name")):
            return "a module has no valid name"
        module = item.get("module")
        if not isinstance(module, str) or len(module) > 500 or not MODULE_PATTERN.fullmatch(module):
            return f"module {item['name']} has no valid module name"
        if item["name"] in names:
            return f"{item['name']} appears twice"
        names.add(item["name"])
    return None


def good_name(name):
    return isinstance(name, str) and 0 < len(name) <= 500 and name.isidentifier() and not name.startswith("_")


def remove(dir):
    """Remove whatever is at `dir` (a folder, a file or a link; never following a link)."""
    if os.path.islink(dir) or (os.path.lexists(dir) and not os.path.isdir(dir)):
        os.unlink(dir)
    elif os.path.isdir(dir):
        shutil.rmtree(dir)
