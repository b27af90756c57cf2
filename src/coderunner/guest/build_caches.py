"""`python build_caches.py FOLDER`: build the first-use caches into FOLDER (ENV/share/coderunner-cache).

Run with the sandbox environment's own Python, never imported: by `coderunner setup` (sandbox/env.py)
after pip, and by the image build (Containerfile). Today one cache: matplotlib's font list, in
FOLDER/matplotlib, as a sandbox would build it but keeping only fonts every sandbox sees
(matplotlib's own, which its list stores relative to its data path, and those under /usr), so that no
sandbox finds a listed font missing and rebuilds. Built under a home of its own: no font of the
user's (~/.fonts, ~/.local/share/fonts) gets in. guest/caches.py puts it in place in each sandbox.
"""

import os
import sys
import tempfile
from pathlib import Path


def build_font_list(target, scratch):
    os.environ.update({"HOME": scratch, "MPLCONFIGDIR": scratch})
    os.environ.pop("XDG_DATA_HOME", None)
    os.environ.pop("XDG_CACHE_HOME", None)
    import matplotlib
    from matplotlib import font_manager

    data = Path(matplotlib.get_data_path())

    def seen(entry):
        path = Path(entry.fname)
        return not path.is_absolute() or path.is_relative_to(data) or path.is_relative_to("/usr")

    manager = font_manager.fontManager
    manager.ttflist = [entry for entry in manager.ttflist if seen(entry)]
    manager.afmlist = [entry for entry in manager.afmlist if seen(entry)]
    name = f"fontlist-v{font_manager.FontManager.__version__}.json"
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o755)
    partial = target / f"{name}.partial"
    font_manager.json_dump(manager, partial)  # an OSError is only logged there: the chmod below then fails
    partial.chmod(0o644)
    partial.replace(target / name)
    for old in target.glob("fontlist-v*.json"):
        if old.name != name:
            old.unlink()
    print(f"{target / name}: {len(manager.ttflist)} fonts")


def main(argv):
    if len(argv) != 2:
        raise SystemExit("usage: python build_caches.py FOLDER")
    folder = Path(argv[1])
    with tempfile.TemporaryDirectory(prefix="coderunner-caches-") as scratch:
        build_font_list(folder / "matplotlib", scratch)


if __name__ == "__main__":
    main(sys.argv)
