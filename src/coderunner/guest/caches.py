"""First-use caches built once by `coderunner setup` (or the image build), put where their programs look.

matplotlib keeps its font list in its cache dir (~/.cache/matplotlib/fontlist-vNNN.json); without
it, the first `import matplotlib` scans every font on the system to build it (seconds, and under load
"Matplotlib is building the font cache") and writes it there. A sandbox's home is a fresh tmpfs, so
every session paid for that in its first chart. Setup builds the list once into the environment
(PREBUILT, read-only in every sandbox: sandbox/env.py build_caches), and each interpreter the product
starts copies what is missing into the cache dir matplotlib will use, before any user code runs. A
copy (tens of KB), not a link: should matplotlib ever rebuild it (a font listed was removed after
setup), it writes its own list over the copy, silently, as with no prebuilt one at all.

Never imports matplotlib (or anything but os): it runs in every kernel's start and every one-shot run.
"""

import os
import sys

#: In the sandbox environment (sys.prefix), where setup left the caches: one folder per program.
PREBUILT = os.path.join(sys.prefix, "share", "coderunner-cache")
#: Most bytes copied of one prebuilt file (a font list is tens of KB).
MAX_BYTES = 16 * 2**20


def matplotlib_cache_dir():
    """Where matplotlib will look for its cache (its own rule: MPLCONFIGDIR, else the XDG cache dir)."""
    configured = os.environ.get("MPLCONFIGDIR")
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "matplotlib")


def seed():
    """Copy the prebuilt caches into place where none is there yet; quietly nothing on any failure."""
    try:  # noqa: SIM105 (not contextlib: a one-shot run imports nothing it need not)
        _copy_missing(os.path.join(PREBUILT, "matplotlib"), matplotlib_cache_dir())
    except OSError:  # no prebuilt caches (an environment from before), or no writable home: as before
        pass


def _copy_missing(source, target):
    names = [name for name in os.listdir(source) if name.endswith(".json")]
    if not names:
        return
    os.makedirs(target, mode=0o700, exist_ok=True)
    for name in names:
        final = os.path.join(target, name)
        if os.path.lexists(final):  # the user's own, or matplotlib's: never replaced
            continue
        with open(os.path.join(source, name), "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            continue
        # Written whole under a name of its own, then linked into place (never over anything): no
        # other interpreter of the sandbox ever reads a half-written list.
        partial = f"{final}.{os.getpid()}.partial"
        try:
            with open(partial, "xb") as out:
                out.write(data)
            os.link(partial, final)
        except FileExistsError:
            pass
        finally:
            try:  # noqa: SIM105 (as above)
                os.unlink(partial)
            except FileNotFoundError:
                pass
