"""What the kernel template does once for every fork's kernel, and what each fork then makes its own (issue 41).

Ahead, in the template after its imports (`prepare`):
- the kernel's command line is parsed into the kernel app: every fork's argv is the template's KERNEL_ARGS, and
  argparse's and traitlets' parse of it was 6-8 CPU-ms of a kernel's start;
- the kernel's shell (ipykernel's ZMQInteractiveShell, a traitlets singleton) is built: its construction was 10
  of the 45 CPU-ms a fork's IPKernelApp.initialize took, and what it builds stays shared with the template
  (copy on write) instead of being made anew in every fork. IPythonKernel asks `shell_class.instance(...)`,
  which hands it this one.

Neither reads anything a sandbox could write: the template's home is its own empty tmpfs (as a new sandbox's
is), the shell is built from the command line's configuration only, and nothing runs in it.

In the fork (`install`, from kernel_boot.main, only when its argv is the one parsed): the parse is skipped, and
once the kernel object is built around the shell, what the shell took from the template's process is made the
fork's own (`adopt`): its kernel, the profile directory in the fork's home, the environment variables the
shell sets (the fork's environment was replaced when it was confined), the working directory and stdin's
encoding it noted, and a history of its own (an SQLite connection must not cross a fork), with the user
namespace's In, Out, _ih, _oh and _dh pointing at it.
"""

from __future__ import annotations

import os
from typing import Any

#: The command line parsed ahead, or None (a kernel started cold: nothing was prepared).
_parsed: list[str] | None = None
#: Whether the shell was built ahead.
_shell_built = False


def prepare(argv: list[str]) -> None:
    """In the template: parse `argv` into the kernel app, then build the kernel's shell from it."""
    global _parsed, _shell_built
    from ipykernel import ipkernel, kernelapp

    app = kernelapp.IPKernelApp.instance()
    app.parse_command_line(argv)
    _parsed = list(argv)
    traits = ipkernel.IPythonKernel.class_traits()
    shell_class, compiler_class = traits["shell_class"].default_value, traits["compiler_class"].default_value
    shell_class.instance(parent=app, compiler_class=compiler_class)
    _shell_built = True


def install(app: Any, argv: list[str]) -> bool:
    """In a fork whose argv is the one parsed ahead: skip the parse, and adopt the shell once the kernel is built.
    False (nothing changed) for any other kernel."""
    if _parsed is None or argv != _parsed:
        return False
    app.parse_command_line = lambda argv=None: None  # done ahead, of this very argv (initialize calls it)
    if _shell_built:
        stock = app.init_kernel

        def init_kernel() -> None:
            stock()
            adopt(app)

        app.init_kernel = init_kernel
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
