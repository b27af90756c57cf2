"""The common imports, paid for by a kernel started ahead (a warm pool member, a session's standby).

The host runs `run()` (or its STEPS one by one) in such a kernel as silent cells (no history, no
execution count, no output kept, no name bound in the user's namespace: sessions/warm_up.py) before
anyone uses it, so that a new session's first chart or first pandas cell finds numpy, pandas and
pyplot imported and their first-use work done: the Agg renderer has drawn text (fonts loaded) and
written a PNG, a frame has been printed and described. What it leaves is what those imports leave in
any kernel (modules in sys.modules, their caches); nothing of the user's namespace.

It never runs the user's code: while it imports, sys.path holds only the read-only folders (the
environment, the standard library, the guest), not the workspace ('') nor the session's packages, so
a numpy.py or six.py that earlier code left there is not what it imports. Whether the user would have
got the same modules is checked again when the kernel is handed over (`still_current`, run by the
standby's swap-in): a standby that preloaded before `install_packages` put another pandas in the
session's packages, or before a module of that name appeared in the workspace, or before a
matplotlibrc did, is not handed out, and the reset starts a kernel cold instead.

matplotlib's backend is not chosen here: the user's first figure chooses it, as in any kernel (the
inline one, or whatever `matplotlib.use()` asked for first). The figure drawn here is made without
pyplot, so pyplot has no figure, number or hook of it. Any failure (a package missing or broken)
ends the preload quietly: the user's own import then says what is wrong.
"""

import os
import sys

#: Top-level modules the preload brought in, with the file each was loaded from (still_current's list).
_loaded: dict = {}
#: The matplotlibrc matplotlib read when it was imported here, and its modification time.
_rc = None
#: The sys.path entries the preload searched (read-only ones): what they provide cannot have changed since.
_searched: set = set()


def _read_only_paths():
    """sys.path without what the sandbox can write: only folders under the environment, the
    interpreter's own prefixes and the guest's folder."""
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(__file__))}
    roots = tuple(os.path.join(folder, "") for folder in folders)
    return [path for path in sys.path if path and os.path.join(os.path.abspath(path), "").startswith(roots)]


def run(*steps):
    """Run the named steps (all of STEPS when none is named), in order; quietly stop at a failure."""
    global _rc
    from importlib.machinery import PathFinder

    before = set(sys.modules)
    saved = list(sys.path)
    read_only = _read_only_paths()
    _searched.update(read_only)
    try:
        sys.path[:] = read_only
        for step in steps or STEPS:
            STEPS[step]()
    except Exception:  # never the warm-up's failure: the kernel is as good as a cold one
        pass
    finally:
        sys.path[:] = saved
        # Each new top-level module a search of sys.path found (not one a package put in sys.modules
        # itself, as pandas does with Cython's _cyutility): what a user's import would search for.
        for name in {name.partition(".")[0] for name in set(sys.modules) - before}:
            origin = getattr(getattr(sys.modules.get(name), "__spec__", None), "origin", None)
            found = PathFinder.find_spec(name, read_only) if origin and os.path.isabs(origin) else None
            if found is not None and found.origin == origin:
                _loaded[name] = origin
        matplotlib = sys.modules.get("matplotlib")
        if matplotlib is not None:
            _rc = _rc_file(matplotlib)


def _numpy():
    import numpy  # noqa: F401 (imported for sys.modules: the user's `import` finds it)


def _pandas():
    import pandas

    frame = pandas.DataFrame({"x": range(3), "y": [0, 1, 0]})
    repr(frame)
    frame._repr_html_()
    frame.groupby("y").x.describe()


def _pyplot():
    import matplotlib.pyplot  # noqa: F401 (as numpy above)


def _draw():
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(2, 1.5))
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    axes.plot([0, 1, 2], [0, 1, 4])
    axes.set_title("warm")
    figure.savefig(io.BytesIO(), format="png", bbox_inches="tight")


#: The preload in steps of a few hundred ms each (a standby runs one cell per step, so a reset waits
#: for one step at most): in order, each step's imports after the ones before it.
STEPS = {"numpy": _numpy, "pandas": _pandas, "pyplot": _pyplot, "draw": _draw}


def _rc_file(matplotlib):
    try:
        name = matplotlib.matplotlib_fname()
        return name, os.stat(name).st_mtime_ns
    except (OSError, AttributeError):
        return None


def _names_in(entry):
    """The top-level names a search of sys.path entry `entry` could find there (a file's name up to its first
    dot, a folder's name), or None if it cannot be listed (then every name is searched for again)."""
    try:
        return {name.partition(".")[0] for name in os.listdir(entry or ".")}
    except FileNotFoundError:  # the session's packages before the first install
        return set()
    except OSError:
        return None


def still_current():
    """Raise unless the user's own imports, now, would find what the preload imported: each module at
    the same file (none now shadowed from the workspace or the session's packages), and the same
    matplotlibrc. Looks only (a listing, a path finder's search, a stat); runs nothing.

    Only a name in an entry the preload did not search (the workspace, the session's packages: what the
    sandbox can write) can be found anywhere else now, so those entries are listed and only the preloaded
    names found there are searched for again (a full search of every name cost a forked kernel's start
    about 1.5 CPU-ms)."""
    from importlib.machinery import PathFinder

    suspects: set = set()
    for entry in sys.path:
        if entry not in _searched:
            names = _names_in(entry)
            suspects |= set(_loaded) if names is None else names & _loaded.keys()
    for name in sorted(suspects):
        origin = _loaded[name]
        spec = PathFinder.find_spec(name, sys.path)
        if spec is None or spec.origin != origin:
            raise ImportError(f"{name} would now be imported from {getattr(spec, 'origin', None)}, not {origin}")
    matplotlib = sys.modules.get("matplotlib")
    if matplotlib is not None and _rc_file(matplotlib) != _rc:
        raise ImportError("matplotlib's configuration file changed since it was imported")
