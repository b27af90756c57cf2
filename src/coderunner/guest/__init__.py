"""Code that runs INSIDE the sandbox, imported there as `coderunner_guest`.

The host never imports this package: it only binds its folder read-only into the sandbox.
It may depend on nothing but the sandbox environment (ipykernel, IPython, the stdlib).
Its kernel start-up hook (load_ipython_extension) imports modules of the package, so those take
their siblings' names (`from .packages import run`), never the package itself (`from . import x`).
"""

import os
import sys

#: Set by the host (sandbox/common.py): the session's package folder, in the sandbox's workspace.
SESSION_PACKAGES_ENV = "SESSION_SITE_PACKAGES"


def user_paths():
    """Give user code the import path an ordinary Jupyter gives it, once the interpreter is up.

    Every interpreter the product starts runs with -P and only read-only folders on PYTHONPATH, so
    nothing in /workspace (the sandbox's to write) is imported before user code. Now the working
    directory ('') and the session's packages go where IPython puts '': after the standard library,
    before the environment's site-packages. Programs user code starts see the packages on PYTHONPATH.
    """
    packages = os.environ.get(SESSION_PACKAGES_ENV, "")
    wanted = [entry for entry in dict.fromkeys(("", packages)) if entry not in sys.path]
    index = next(
        (i for i, path in enumerate(sys.path) if os.path.basename(path) in ("site-packages", "dist-packages")),
        len(sys.path),
    )
    sys.path[index:index] = wanted
    if packages:
        parts = [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part]
        if packages not in parts:
            os.environ["PYTHONPATH"] = os.pathsep.join([*parts, packages])


def load_ipython_extension(ipython):
    """Loaded by the kernel at start (IPKernelApp.extensions): the last of its start-up."""
    from . import caches, figures, installs, output

    caches.seed()  # before any user code can import matplotlib
    output.install()
    figures.install(ipython)
    installs.install(ipython)
    user_paths()
