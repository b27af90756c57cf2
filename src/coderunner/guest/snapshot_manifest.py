"""A snapshot's manifest.json: read back bounded and checked to be what save writes, before any
pickle it names is opened. Runs inside the sandbox, as coderunner_guest.
"""

import json
import os
import re

from .errors import GuestError

MANIFEST = "manifest.json"
FORMAT = "coderunner-kernel-state"
VERSION = 1
#: The manifest is small (names and types); a larger one is not ours.
MANIFEST_LIMIT = 16 * 1024 * 1024
FILE_PATTERN = re.compile(r"v-[0-9]{4,7}\.pkl")
MODULE_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


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


def saved_skipped(manifest):
    """What the save left out (named with its reason), so a restore can say it did not come back."""
    skipped = manifest.get("skipped")
    out = []
    for item in skipped if isinstance(skipped, list) else []:
        if isinstance(item, dict) and all(isinstance(item.get(key), str) for key in ("name", "type", "reason")):
            out.append({key: item[key][:200] for key in ("name", "type", "reason")})
    return out[:10_000]
