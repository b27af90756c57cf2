"""Pickling one variable of a snapshot: cloudpickle, bounded in bytes, straight to its file.

A cell-defined function's globals are pickled as a marker for "the kernel's namespace" (the
marker's class lives in snapshot.py: pickles name it there), and the names that come back on
their own are not copied into its pickle. Runs inside the sandbox, as coderunner_guest.
"""

import contextlib
import io
import os
import pickle

PROTOCOL = 5


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


class Context:
    """What the pickles of one save share."""

    def __init__(self, namespace, separate, marker):
        self.namespace = namespace
        #: Names that come back on their own (the user's variables, IPython's objects): not copied
        #: into the pickle of a function that uses them.
        self.separate = frozenset(separate)
        #: What the pickles hold instead of the kernel's namespace (snapshot.NamespaceMarker).
        self.marker = marker


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


PICKLER: list[type] = []


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
