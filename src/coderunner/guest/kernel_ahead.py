"""What the kernel template does once for every fork's kernel, and what each fork then makes its own (issue 41).

Ahead, in the template after its imports (`prepare`):
- the kernel's command line is parsed into the kernel app: every fork's argv is the template's KERNEL_ARGS, and
  argparse's and traitlets' parse of it was 6-8 CPU-ms of a kernel's start;
- the kernel's shell (ipykernel's ZMQInteractiveShell, a traitlets singleton) is built: its construction was 10
  of the 45 CPU-ms a fork's IPKernelApp.initialize took, and what it builds stays shared with the template
  (copy on write) instead of being made anew in every fork. IPythonKernel asks `shell_class.instance(...)`,
  which hands it this one. Its display formatters too, which it would build at a fork's first result.

Neither reads anything a sandbox could write: the template's home is its own empty tmpfs (as a new sandbox's
is), the shell is built from the command line's configuration only, and nothing runs in it.

In the fork (`install`, from kernel_boot.main, only when its argv is the one parsed): the parse is skipped, no
heartbeat is started (see `install`), and once the kernel object is built around the shell, what the shell took
from the template's process is made the fork's own (`adopt`): its kernel, the profile directory in the fork's
home, the environment variables the shell sets (the fork's environment was replaced when it was confined), the
working directory and stdin's encoding it noted, and a history of its own (an SQLite connection must not cross a
fork), with the user namespace's In, Out, _ih, _oh and _dh pointing at it.

Also ahead: the list of loaded modules' files that IPythonKernel.__init__ gives its debugger (`_kernel_modules`).
It builds it by walking every module in sys.modules (about 1,300 after the template's imports) and asking each
for `__file__`: each touch writes that module's refcount and its name's, so in a fork it copied about 1,400
pages (5.5 MiB) of the template's memory into the kernel and cost a few CPU-ms. In the fork (`modules_ahead`),
that walk is given the template's modules as small stand-ins made here (contiguous, so a few pages), then the
modules imported since the template was ready (the newest end of sys.modules, which keeps import order).
The same for the set of loaded modules' names that IPython's init_code keeps for `%reset --aggressive`
(`set(sys.modules.keys())`: a reference to every name, about 390 pages copied and 1.5 CPU-ms a start): the
template's set is made here, and the fork adds the names imported since to it (`names_ahead`). And whether each
builtin type is each abstract collection (`answer_abcs`): an ABC's first answer about a type is a walk over all
its subclasses.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

#: The command line parsed ahead, or None (a kernel started cold: nothing was prepared).
_parsed: list[str] | None = None
#: Whether the shell was built ahead.
_shell_built = False
#: The display formatters built with the shell (None: not built ahead).
_formatters: dict[str, Any] | None = None


class ModuleFile:
    """A loaded module's stand-in in IPythonKernel.__init__'s walk: its file only (a copy, made next to the
    others: the walk's touches stay on a few pages)."""

    __slots__ = ("__file__",)

    def __init__(self, file: str) -> None:
        self.__file__ = file.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


#: A stand-in for each module loaded when the template was ready, and how many entries sys.modules had then
#: (None: not made, as in a cold kernel).
_module_files: tuple[ModuleFile, ...] = ()
_modules_then: int | None = None
#: The names in sys.modules when the template was ready (None: not made).
_module_names: set[str] | None = None


def prepare(argv: list[str]) -> None:
    """In the template: parse `argv` into the kernel app, then build the kernel's shell from it."""
    global _parsed, _shell_built
    from ipykernel import ipkernel, kernelapp

    app = kernelapp.IPKernelApp.instance()
    app.parse_command_line(argv)
    _parsed = list(argv)
    traits = ipkernel.IPythonKernel.class_traits()
    shell_class, compiler_class = traits["shell_class"].default_value, traits["compiler_class"].default_value
    shell = shell_class.instance(parent=app, compiler_class=compiler_class)
    build_formatters(shell.display_formatter)
    _shell_built = True


def build_formatters(display: Any) -> None:
    """The display formatter's formatters, which traitlets builds at their first use: a fork's first result
    built them (a dozen configurables, each reading its config: about 0.7 of a first `1+1`'s 2.8 CPU-ms).
    Only built, nothing formatted: they hold the shell's configuration and nothing of a process."""
    global _formatters
    for name in ("ipython_display_formatter", "mimebundle_formatter"):
        getattr(display, name, None)
    _formatters = display.formatters


#: The types whose answers against collections.abc are made ahead (answer_abcs).
ANSWERED_TYPES = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset, type(None))


def answer_abcs() -> None:
    """Whether each builtin type is each of collections.abc's classes, answered once here (0.5 ms).

    An ABC asked about a type it does not know yet walks every one of its subclasses (with pandas and matplotlib
    loaded, hundreds of classes), taking a reference to each: in a fork, that wrote about 110 pages of the
    template's, for one `isinstance(a_list, Mapping)` logging makes while the kernel starts. Answered here, the
    fork finds the answer in the ABC's caches (a `register` anywhere since then voids the negative answers, and
    that walk happens as before)."""
    import collections.abc

    classes = [value for value in vars(collections.abc).values() if isinstance(value, type)]
    for kind in ANSWERED_TYPES:
        for abstract in classes:
            issubclass(kind, abstract)


def note_modules() -> None:
    """In the template, last before its GC is frozen: the stand-ins of every loaded module with a file."""
    global _module_files, _modules_then, _module_names
    modules = list(sys.modules.values())
    files = [getattr(module, "__file__", None) for module in modules]
    _module_files = tuple(ModuleFile(file) for file in files if isinstance(file, str) and file)
    _module_names = set(sys.modules)
    _modules_then = len(modules)


def _names_since() -> Iterator[str]:
    """The names of the modules imported since the template was ready (the newest end of sys.modules)."""
    assert _modules_then is not None
    since = len(sys.modules) - _modules_then
    return itertools.islice(reversed(sys.modules), since) if since > 0 else iter(())


class _ModulesAhead:
    """What IPythonKernel.__init__'s `sys.modules.copy().values()` finds in a fork: the stand-ins, then the
    modules imported since (see the module docstring). Anything else asked of it is the real sys.modules's."""

    def copy(self) -> _ModulesAhead:
        return self

    def values(self) -> Iterator[Any]:
        newest = [sys.modules[name] for name in _names_since()]
        return itertools.chain(_module_files, reversed(newest))

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.modules, name)


class _SysAhead:
    """The `sys` ipykernel.ipkernel sees while its kernel is built: the real one but for `modules` (what it
    sets goes to the real one too)."""

    modules = _ModulesAhead()

    def __getattr__(self, name: str) -> Any:
        return getattr(sys, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(sys, name, value)


@contextlib.contextmanager
def modules_ahead() -> Iterator[None]:
    """While a fork's kernel is built: its module walk over the template's stand-ins. Nothing changes if they
    were not made, if a module was removed since (the count would mislead), or in an ipykernel without the walk."""
    from ipykernel import ipkernel

    if _modules_then is None or len(sys.modules) < _modules_then or getattr(ipkernel, "sys", None) is not sys:
        yield
        return
    ipkernel.sys = _SysAhead()
    try:
        yield
    finally:
        ipkernel.sys = sys


class _NamesAsked:
    """What IPython's init_code finds as `sys.modules` while it runs (its `set(sys.modules.keys())` is given no
    name, and the set is made in `names_ahead`): the real one but for `keys`."""

    def __init__(self) -> None:
        self.asked = False

    def keys(self) -> tuple[()]:
        self.asked = True
        return ()

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.modules, name)


class _SysNamesAsked:
    """The `sys` IPython.core.shellapp sees while init_code runs: the real one but for `modules`."""

    def __init__(self) -> None:
        object.__setattr__(self, "modules", _NamesAsked())

    def __getattr__(self, name: str) -> Any:
        return getattr(sys, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(sys, name, value)


@contextlib.contextmanager
def names_ahead(app: Any) -> Iterator[None]:
    """While a fork's init_code runs: its set of loaded modules' names is the template's, with the names
    imported since added (see the module docstring). Nothing changes if the set was not made, if a module was
    removed since, or in an IPython whose init_code does not ask for them."""
    from IPython.core import shellapp

    if (
        _module_names is None
        or _modules_then is None
        or len(sys.modules) < _modules_then
        or getattr(shellapp, "sys", None) is not sys
    ):
        yield
        return
    asking = _SysNamesAsked()
    shellapp.sys = asking
    try:
        yield
    finally:
        shellapp.sys = sys
    if asking.modules.asked:
        _module_names.update(_names_since())
        app.shell._sys_modules_keys = _module_names


def install(app: Any, argv: list[str]) -> bool:
    """In a fork whose argv is the one parsed ahead: skip the parse, and adopt the shell once the kernel is built.
    False (nothing changed) for any other kernel."""
    if _parsed is None or argv != _parsed:
        return False
    app.parse_command_line = lambda argv=None: None  # done ahead, of this very argv (initialize calls it)
    # No heartbeat: the host never uses it (kernel/process.py's HOST_CHANNELS), and ipykernel gives it a thread
    # and a ZMQ context (another thread) of their own. Only a fork goes without: the backends that forward every
    # channel (the gVisor relay, the Apple VM) wait for its port, and forks run on bwrap alone.
    app.init_heartbeat = lambda: None  # `heartbeat` stays None, which ipykernel's close allows for
    if _shell_built:
        stock = app.init_kernel

        def init_kernel() -> None:
            with modules_ahead():
                stock()
            adopt(app)

        app.init_kernel = init_kernel
    stock_code = app.init_code

    def init_code() -> None:
        with names_ahead(app):
            stock_code()

    app.init_code = init_code
    return True


def adopt(app: Any) -> None:
    """Make the shell built in the template this fork's kernel's own (see the module docstring)."""
    kernel = app.kernel
    shell = kernel.shell
    shell.kernel = kernel
    shell.profile_dir = app.profile_dir
    shell.starting_dir = os.getcwd()
    shell.init_environment()
    shell.init_encoding()
    shell.init_history()
    shell.init_user_ns()
