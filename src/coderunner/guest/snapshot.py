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

The parts: snapshot_pickling.py (one variable to its file, bounded), snapshot_values.py (whose a
name is, what is live, the reasons given), snapshot_manifest.py (the manifest read back and
checked). NamespaceMarker and kernel_namespace stay here: every saved pickle names them by this
module's path.

Memory: pickles are written straight to their files (protocol 5, so a numpy array's buffer goes
to the file without a copy) and read straight back, so saving or loading a large array needs
about its own size, not twice that.
"""

import json
import os
import pickle
import shutil
import sys
import types

from .errors import GuestError
from .snapshot_manifest import FORMAT, MANIFEST, VERSION, read_manifest, saved_skipped
from .snapshot_pickling import Context, TooLarge, WriteFailed, dump, pickler_class
from .snapshot_values import (
    class_module,
    import_failure,
    ipython_names,
    live_resource,
    loading_failure,
    of_the_guest,
    pickling_failure,
    too_large,
    type_name,
    user_names,
    write_failure,
)

#: What never travels in a snapshot, in plain words (every reply lists it).
NOT_CARRIED = [
    "running threads and tasks",
    "open files and sockets",
    "subprocesses and database connections",
    "the browser page",
    "the kernel's history (In/Out) and names starting with _",
]


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
    saved: list[dict] = []
    modules: list[dict] = []
    skipped: list[dict] = []
    entries: list[dict] = []
    total = 0
    names = user_names(ipython, namespace)
    context = Context(namespace, set(names) | ipython_names(ipython, namespace), NamespaceMarker())
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


class NamespaceMarker(dict):
    """Stands for the kernel's namespace as the globals of cell-defined functions in a pickle."""

    def __reduce__(self):
        return kernel_namespace, ()


def kernel_namespace():
    """At load: the namespace of the kernel loading the pickle (a restored function's globals)."""
    return shell().user_ns


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


def import_module(name):
    import importlib

    return importlib.import_module(name)


def unpickle(path):
    with open(path, "rb") as file:
        return pickle.load(file)


def remove(dir):
    """Remove whatever is at `dir` (a folder, a file or a link; never following a link)."""
    if os.path.islink(dir) or (os.path.lexists(dir) and not os.path.isdir(dir)):
        os.unlink(dir)
    elif os.path.isdir(dir):
        shutil.rmtree(dir)
