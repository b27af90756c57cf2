"""Code that runs INSIDE the sandbox, imported there as `coderunner_guest`.

The host never imports this package: it only binds its folder read-only into the sandbox.
It may depend on nothing but the sandbox environment (ipykernel, IPython, the stdlib).
"""


def load_ipython_extension(ipython):  # type: ignore[no-untyped-def]
    """Loaded by the kernel at start (IPKernelApp.extensions)."""
    from . import figures, output

    output.install()
    figures.install(ipython)
