"""The guest's kernel-state saver (coderunner_guest/snapshot.py), run in the sandbox env's Python.

Each test saves from one IPython shell and loads in a SECOND fresh process, as a restore does:
nothing can come back from the saving process's memory.
"""

import hashlib
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

GUEST = Path(__file__).resolve().parents[1] / "src" / "coderunner" / "guest"
TIMEOUT_S = 300

PRELUDE = """
import json, os, resource, sys
from IPython.core.interactiveshell import InteractiveShell

sys.path.insert(0, "")  # as in a kernel: modules in the working directory import
shell = InteractiveShell.instance(colors="nocolor")


def cell(code):
    result = shell.run_cell(code)
    if not result.success:
        raise SystemExit(f"cell failed: {code!r}: {result.error_in_exec or result.error_before_exec!r}")


from coderunner_guest import snapshot
from coderunner_guest.errors import GuestError


def answer(value):
    print("ANSWER " + json.dumps(value))
"""


def sandbox_python() -> Path:
    from coderunner.config import load_settings

    python = load_settings().sandbox_env / "bin" / "python"
    if not python.exists():
        pytest.skip("no sandbox environment here (coderunner setup)")
    return python


def run_guest(tmp_path: Path, body: str, cwd: Path) -> dict:
    """Run PRELUDE + body in a fresh sandbox-env Python with the guest importable; its answer."""
    lib = tmp_path / "lib"
    if not lib.exists():
        lib.mkdir()
        (lib / "coderunner_guest").symlink_to(GUEST)
    script = tmp_path / "script.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(lib), "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": str(tmp_path), "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "agg"}  # fmt: skip
    done = subprocess.run(
        [str(sandbox_python()), str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("ANSWER ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("ANSWER ") :])


def tree(folder: Path) -> dict[str, tuple[int, str]]:
    return {
        p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(folder.iterdir())
    }


SAVE_CELLS = r"""
cells = [
    "import numpy as np, pandas as pd, threading, socket",
    "import numpy.polynomial as poly",
    "import mymod",
    "from coderunner_guest import variables as guest_variables",
    "df = pd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})",
    "arr = np.arange(12.0).reshape(3, 4)",
    "factor = 3",
    "def helper(x):\n    return x * factor",
    "def uses(x):\n    return helper(x) + 1",
    "square = lambda v: v * v",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
    "    def norm2(self):\n        return self.x ** 2 + self.y ** 2",
    "p = Point(3, 4)",
    "model = np.polynomial.Polynomial.fit([0, 1, 2, 3], [1, 3, 5, 7], 1)",
    "nested = {'a': [1, {'b': (2, 3)}], 'c': None, 'd': [p, square]}",
    "thing = mymod.Thing(7)",
    "in_shell = lambda: get_ipython() is not None",
    "shell_itself = get_ipython()",
    "big = np.ones(1024 * 1024)",
    "def big_sum():\n    return float(big.sum())",
    "fh = open('data.txt', 'w')",
    "lock = threading.Lock()",
    "stop = threading.Event()",
    "worker = threading.Thread(target=stop.wait, daemon=True); worker.start()",
    "gen = (i for i in range(3))",
    "sock = socket.socket()",
    "box = {'inner': open('data.txt')}",
    "_private = 1",
    "1 + 1",
]
for code in cells:
    cell(code)
"""


CHECKS = """
assert __import__('os').getcwd() == {work!r}
assert uses(2) == 7
factor = 10
assert uses(2) == 21, "a restored function reads the kernel's globals, not a private copy"
def helper(x):
    return -x
assert uses(2) == -1, "and sees a function redefined after the restore"
assert isinstance(p, Point) and p.norm2() == 25 and nested['d'][0].norm2() == 25
assert square(5) == 25 and nested['d'][1](3) == 9
assert round(float(model(4)), 6) == 9.0
assert list(df['a']) == [1, 2, 3] and list(df['b']) == ['x', 'y', 'z']
assert arr.shape == (3, 4) and arr.sum() == 66.0 and np.__name__ == 'numpy' and poly.Polynomial
assert nested['a'] == [1, {{'b': (2, 3)}}] and nested['c'] is None
assert in_shell()
assert big_sum() == 1024 * 1024
big = np.ones(3)
assert big_sum() == 3
assert 'fh' not in dir() and 'lock' not in dir() and '_private' not in dir()
"""


def test_state_survives_a_fresh_kernel_and_live_resources_are_named(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymod.py").write_text("class Thing:\n    def __init__(self, n):\n        self.n = n\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "v-0099.pkl").write_text("stale")  # an old save in the way is replaced, not mixed in

    saved = run_guest(tmp_path, SAVE_CELLS + f"answer(snapshot.run('save', {str(state)!r}))\n", work)

    assert [item["name"] for item in saved["saved"]] == [
        "df", "arr", "factor", "helper", "uses", "square", "Point", "p", "model", "nested", "thing", "in_shell",
        "big", "big_sum",
    ]  # fmt: skip
    sizes = {item["name"]: item["bytes"] for item in saved["saved"]}
    assert all(size > 0 for size in sizes.values())
    assert sizes["big"] > 8 * 1024 * 1024 and sizes["big_sum"] < 10_000, "a function carries no copy of a variable"
    assert {item["name"]: item["type"] for item in saved["saved"]}["df"] == "DataFrame"
    assert saved["modules"] == [
        {"name": "np", "module": "numpy"}, {"name": "pd", "module": "pandas"},
        {"name": "threading", "module": "threading"}, {"name": "socket", "module": "socket"},
        {"name": "poly", "module": "numpy.polynomial"}, {"name": "mymod", "module": "mymod"},
    ]  # fmt: skip
    reasons = {item["name"]: item["reason"] for item in saved["skipped"]}
    assert reasons == {
        "guest_variables": "part of CodeRunner itself (import it again)",
        "shell_itself": "the IPython shell (get_ipython() gives it again)",
        "fh": "an open file handle",
        "lock": "a lock",
        "stop": "a lock",
        "worker": "a thread",
        "gen": "a generator or coroutine",
        "sock": "a socket",
        "box": "holds an open file handle",
    }
    assert "the browser page" in saved["not_carried"] and "open files and sockets" in saved["not_carried"]
    assert saved["cwd"] == str(work)
    files = sorted(p.name for p in state.iterdir())
    assert files == ["manifest.json"] + [f"v-{n:04d}.pkl" for n in range(1, 15)]
    assert saved["bytes"] == sum(p.stat().st_size for p in state.iterdir())

    (work / "mymod.py").unlink()  # the restored kernel cannot import it: named, the rest come back
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = tree(state)
    checks = CHECKS.format(work=str(work))
    loaded = run_guest(
        tmp_path,
        f"""
        result = snapshot.run("load", {str(state)!r})
        checks = {checks!r}
        cell(checks)
        answer(result)
        """,
        elsewhere,
    )
    assert loaded["restored"] == [
        "df", "arr", "factor", "helper", "uses", "square", "Point", "p", "model", "nested", "in_shell", "big",
        "big_sum",
    ]  # fmt: skip
    assert loaded["modules"] == ["np", "pd", "threading", "socket", "poly"]
    assert loaded["failed"] == [
        {"name": "mymod", "reason": "its module 'mymod' is not importable here"},
        {"name": "thing", "reason": "its module 'mymod' is not importable here"},
    ]
    assert loaded["not_carried"] == saved["not_carried"]
    assert loaded["skipped"] == saved["skipped"]
    assert tree(state) == before, "load wrote into the snapshot folder"
    # The host's schema for these accounts takes what the guest writes whole (cwd is not kept).
    from coderunner.sessions.snapshot_reports import LoadReport, SaveReport, bounded_report

    assert bounded_report(saved, SaveReport) == {key: value for key, value in saved.items() if key != "cwd"}
    assert bounded_report(loaded, LoadReport) == loaded


def test_a_state_past_the_limit_is_refused_with_the_biggest_names_and_leaves_no_folder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    answer = run_guest(
        tmp_path,
        f"""
        cell("import numpy as np")
        cell("small = list(range(10))")
        cell("big = np.ones(3 * 1024 * 1024 // 8)")
        cell("bigger = np.ones(5 * 1024 * 1024 // 8)")
        first = snapshot.run("save", {str(state)!r})
        try:
            snapshot.run("save", {str(state)!r}, limit_bytes=1024 * 1024)
        except GuestError as exc:
            answer({{"first": first["bytes"], "error": str(exc), "left": os.path.lexists({str(state)!r})}})
        else:
            answer({{"error": None}})
        """,
        tmp_path,
    )
    assert answer["first"] > 8 * 1024 * 1024
    error = answer["error"]
    assert error is not None and error.startswith("the kernel state is larger than the snapshot limit (1 MiB")
    assert "biggest variables: bigger (5 MiB), big (3 MiB), small (" in error
    assert "ask the user to raise snapshot_limit_mb" in error
    assert answer["left"] is False


def test_a_manifest_that_save_did_not_write_is_refused(tmp_path: Path) -> None:
    def manifest(**changes: object) -> str:
        return json.dumps(
            {
                "format": "coderunner-kernel-state",
                "version": 1,
                "python": "3.11",
                "cwd": "/",
                "variables": [],
                "modules": [],
            }
            | changes
        )

    cases = {
        "well formed": manifest(),
        "missing": None,
        "not json": "{",
        "other format": manifest(format="x"),
        "path in file": manifest(variables=[{"name": "a", "file": "../../etc/passwd"}]),
        "bad module": manifest(modules=[{"name": "os", "module": "os; print(1)"}]),
        "private name": manifest(variables=[{"name": "__builtins__", "file": "v-0001.pkl"}]),
    }
    for case, text in cases.items():
        folder = tmp_path / case.replace(" ", "-")
        folder.mkdir()
        if text is not None:
            (folder / "manifest.json").write_text(text)
    answers = run_guest(
        tmp_path,
        f"""
        out = {{}}
        for case in {list(cases)!r}:
            try:
                out[case] = snapshot.run("load", os.path.join({str(tmp_path)!r}, case.replace(" ", "-")))
            except GuestError as exc:
                out[case] = "refused: " + str(exc)
        answer(out)
        """,
        tmp_path,
    )
    assert answers["well formed"]["restored"] == [] and answers["well formed"]["failed"] == []
    assert answers["missing"].startswith("refused: no snapshot in")
    assert answers["not json"] == "refused: the snapshot's manifest.json is not valid JSON"
    for case in ("other format", "path in file", "bad module", "private name"):
        assert answers[case].startswith("refused: the snapshot's manifest.json is not one CodeRunner wrote"), case


def test_a_big_array_is_saved_and_loaded_without_a_second_copy_in_memory(tmp_path: Path) -> None:
    """Streaming: saving adds far less than the array's size; loading needs about its size once."""
    size_mib = 256
    state = tmp_path / "state"
    saved = run_guest(
        tmp_path,
        f"""
        cell("import numpy as np")
        cell("big = np.ones({size_mib} * 1024 * 1024 // 8)")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = snapshot.run("save", {str(state)!r})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        answer({{"bytes": result["bytes"], "grew_kib": after - before}})
        """,
        tmp_path,
    )
    assert saved["bytes"] > size_mib * 1024 * 1024
    assert saved["grew_kib"] < 64 * 1024, f"saving grew the peak by {saved['grew_kib'] // 1024} MiB"
    loaded = run_guest(
        tmp_path,
        f"""
        cell("import numpy as np")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = snapshot.run("load", {str(state)!r})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cell("assert big.shape == ({size_mib} * 1024 * 1024 // 8,) and float(big[::4096].sum()) == big.size / 4096")
        answer({{"restored": result["restored"], "grew_kib": after - before}})
        """,
        tmp_path,
    )
    assert loaded["restored"] == ["big"]
    assert loaded["grew_kib"] < (size_mib + 64) * 1024, f"loading grew the peak by {loaded['grew_kib'] // 1024} MiB"


def test_a_write_error_stops_the_save_instead_of_skipping_variables(tmp_path: Path) -> None:
    """A full disk is the save's failure (said plainly, nothing left behind), not the variable's."""
    state = tmp_path / "state"
    answer = run_guest(
        tmp_path,
        f"""
        import signal
        cell("import numpy as np")
        cell("small = 1")
        cell("big = np.ones(3 * 1024 * 1024 // 8)")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, 1024 * 1024))
        try:
            result = snapshot.run("save", {str(state)!r})
        except GuestError as exc:
            answer({{"error": str(exc), "left": os.path.lexists({str(state)!r})}})
        else:
            answer({{"error": None, "result": result}})
        """,
        tmp_path,
    )
    assert answer["error"] == "the kernel state could not be written: File too large"
    assert answer["left"] is False
