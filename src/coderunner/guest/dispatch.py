"""The host calls guest tools through this: one awaited expression, answered by one display bundle.

The host runs `await __import__("coderunner_guest.dispatch", fromlist=["call"]).call(TOOL, ARGS_JSON)`
silently (no history, no execution count, no names bound in the user's namespace) and reads the
result from a display_data message with RESULT_MIME.
"""

import contextlib
import importlib
import inspect
import json
import os
import sys

from .errors import GuestError

RESULT_MIME = "application/vnd.coderunner.guest+json"
TOOLS = {
    "pdf_ops": "coderunner_guest.pdf",
    "image_ops": "coderunner_guest.image",
    "browser": "coderunner_guest.browser",
    "variables": "coderunner_guest.variables",
    "packages": "coderunner_guest.packages",
    "snapshot": "coderunner_guest.snapshot",
}


def called_as(tool, op):
    """The MCP tool a guest tool's op is called through, as its messages name it: pdf_ops and image_ops
    are tools of their own name; each browser op is the tool browser_<op>."""
    return f"browser_{op}" if tool == "browser" and isinstance(op, str) and op.isidentifier() else tool


#: Modules the product's own work on a tool's input imports by name: loaded from read-only folders
#: first (a snapshot's pickles name cloudpickle; the user's own modules they name still load as theirs).
PRELOADS = {"snapshot": ("cloudpickle",)}
#: Tools whose whole run imports only from read-only folders (snapshot loads the user's own modules).
SEALED = frozenset(TOOLS) - {"snapshot"}


@contextlib.contextmanager
def read_only_imports():
    """sys.path cut to the environment, the stdlib and the guest while the product's code imports:
    never '' or the workspace (the sandbox's to write), so a planted PIL.py or cloudpickle/ is not
    what a tool runs."""
    roots = tuple(
        os.path.join(root, "")
        for root in {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    )
    saved = sys.path[:]
    sys.path[:] = [path for path in saved if os.path.isabs(path) and os.path.join(path, "").startswith(roots)]
    try:
        yield
    finally:
        sys.path[:] = saved


def run_op(tool, ops, op, input_path, args):
    """Call `ops[op](input_path, **args)` after checking the op and its argument names.

    A missing or unknown argument is the caller's mistake and gets a message naming it, not the
    TypeError Python would raise (whose text names private functions).
    """
    from .paths import existing_file

    if op not in ops:
        raise GuestError(f"unknown {tool} op {op!r}; valid ops: {', '.join(ops)}")
    args = {} if args is None else args
    if not isinstance(args, dict):
        raise GuestError(f'{tool} {op}: args must be an object of named arguments, e.g. {{"pages": "1-3"}}')
    function = ops[op]
    params = list(inspect.signature(function).parameters.values())[1:]  # the first is the input path
    names = [param.name for param in params]
    unknown = sorted(set(args) - set(names))
    if unknown:
        takes = ", ".join(names) or "no arguments"
        raise GuestError(f"{tool} {op}: unknown argument(s) {', '.join(unknown)}; {op} takes: {takes}")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in args]
    if missing:
        needed = ", ".join(missing)
        raise GuestError(f"{tool} {op} needs {needed} (it takes: {', '.join(names)})")
    return function(existing_file(input_path), **args)


def unexpected(tool, args_json, exc):
    """A plain answer for an error no op foresaw: which op failed, and what the caller can check.

    The exception's own text is not passed on: it comes from a parser fed untrusted bytes and
    names library internals; the kind of failure is enough to say what to check.
    """
    try:
        request = json.loads(args_json)
    except ValueError:
        request = {}
    request = request if isinstance(request, dict) else {}
    op = request.get("op")
    op = op if isinstance(op, str) and len(op) < 40 else None
    called = called_as(tool, op)
    name = called if tool == "browser" else f"{called} {op}" if op else called
    target = request.get("input_path")
    target = target if isinstance(target, str) and len(target) < 300 else "the input"
    if tool == "browser":
        return (
            f"{name} failed unexpectedly; check that a page is open (browser_navigate first) and the selector and "
            "arguments; kernel_reset gives a fresh browser if it keeps failing"
        )
    if isinstance(exc, OSError):
        reason = os.strerror(exc.errno) if exc.errno else "a file could not be read or written"
        return f"{name} failed on {target}: {reason}; check input_path and any output paths"
    if isinstance(exc, (TypeError, ValueError, KeyError, IndexError, AttributeError)):
        return (
            f"{name} failed on {target}: an argument has the wrong type or value, or the file is damaged; "
            "check the arguments (pages like '1-3,5', numbers as numbers) and that the file opens"
        )
    if target == "the input":
        return f"{name} failed unexpectedly; check its arguments"
    return (
        f"{name} could not process {target}: the file may be damaged, unsupported or not of the expected kind; "
        "check that it opens (e.g. with op 'info') and try again"
    )


async def call(tool, args_json):
    from IPython.display import display

    try:
        if tool not in TOOLS:
            raise GuestError(f"unknown guest tool {tool!r}")
        with read_only_imports():
            module = importlib.import_module(TOOLS[tool])
            for name in PRELOADS.get(tool, ()):
                importlib.import_module(name)
        with read_only_imports() if tool in SEALED else contextlib.nullcontext():
            result = module.run(**json.loads(args_json))
            if inspect.isawaitable(result):
                result = await result
        payload = {"ok": True, "result": result}
    except GuestError as exc:
        payload = {"ok": False, "error": str(exc)}
    except MemoryError:
        payload = {"ok": False, "error": "out of memory while handling this input"}
    except Exception as exc:  # untrusted input: any parser error is the caller's answer, not a crash
        payload = {"ok": False, "error": unexpected(tool, args_json, exc)}
    display({RESULT_MIME: payload}, raw=True)
