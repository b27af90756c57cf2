"""The host calls guest tools through this: one awaited expression, answered by one display bundle.

The host runs `await __import__("coderunner_guest.dispatch", fromlist=["call"]).call(TOOL, ARGS_JSON)`
silently (no history, no execution count, no names bound in the user's namespace) and reads the
result from a display_data message with RESULT_MIME.
"""

import importlib
import inspect
import json

RESULT_MIME = "application/vnd.coderunner.guest+json"
TOOLS = {
    "pdf_ops": "coderunner_guest.pdf",
    "image_ops": "coderunner_guest.image",
    "browser": "coderunner_guest.browser",
    "variables": "coderunner_guest.variables",
    "packages": "coderunner_guest.packages",
}


class GuestError(Exception):
    """A failure to report to the caller as it is (bad input, unknown op, ...)."""


async def call(tool, args_json):
    from IPython.display import display

    try:
        if tool not in TOOLS:
            raise GuestError(f"unknown guest tool {tool!r}")
        module = importlib.import_module(TOOLS[tool])
        result = module.run(**json.loads(args_json))
        if inspect.isawaitable(result):
            result = await result
        payload = {"ok": True, "result": result}
    except GuestError as exc:
        payload = {"ok": False, "error": str(exc)}
    except MemoryError:
        payload = {"ok": False, "error": "out of memory while handling this input"}
    except Exception as exc:  # untrusted input: any parser error is the caller's answer, not a crash
        payload = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    display({RESULT_MIME: payload}, raw=True)
