"""Save and load time, and peak memory, of the guest's kernel-state saver for big data, lanes interleaved.

    .venv/bin/python bench/guest_snapshot.py [--rounds 3] [--size-mb 500] [--memory-mb 2048]

Each measurement is a fresh process of the sandbox env's Python with an IPython shell (as the
kernel is), holding `--size-mb` of data, under an address-space limit of `--memory-mb`:
- snapshot-array: coderunner_guest.snapshot save, then load in a second fresh process, of a numpy array;
- snapshot-frame: the same for a pandas DataFrame of float columns of that size;
- np-save (baseline): numpy.save / numpy.load of the same array, the fastest plain way to move it.
Reports the median seconds of save and load, the peak RSS (MiB) of each process and how much the
save or load itself added to it, beside the
baseline measured in the same run. The data is made before the clock starts; the page cache is
not dropped (the machine is shared), so a load reads from memory where it can.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUEST = REPO / "src" / "coderunner" / "guest"

PRELUDE = """
import json, resource, sys, time
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
def cell(code):
    assert shell.run_cell(code).success, code
from coderunner_guest import snapshot
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""

MAKE = {
    "array": "import numpy as np\nbig = np.random.default_rng(1).random({n})",
    "frame": "import numpy as np, pandas as pd\n"
    "big = pd.DataFrame(np.random.default_rng(1).random(({n} // 8, 8)), columns=list('abcdefgh'))",
}

SNAPSHOT_SAVE = """
cell({make!r})
before = peak_mib()
start = time.perf_counter()
result = snapshot.run("save", {state!r})
print(json.dumps({{"s": time.perf_counter() - start, "peak": peak_mib(), "grew": peak_mib() - before}}))
"""
SNAPSHOT_LOAD = """
cell({imports!r})
before = peak_mib()
start = time.perf_counter()
result = snapshot.run("load", {state!r})
assert result["restored"] == ["big"], result
print(json.dumps({{"s": time.perf_counter() - start, "peak": peak_mib(), "grew": peak_mib() - before}}))
"""
NP_SAVE = """
cell({make!r})
before = peak_mib()
start = time.perf_counter()
shell.user_ns["np"].save({state!r} + "/big.npy", shell.user_ns["big"])
print(json.dumps({{"s": time.perf_counter() - start, "peak": peak_mib(), "grew": peak_mib() - before}}))
"""
NP_LOAD = """
cell("import numpy as np")
before = peak_mib()
start = time.perf_counter()
shell.user_ns["big"] = shell.user_ns["np"].load({state!r} + "/big.npy")
print(json.dumps({{"s": time.perf_counter() - start, "peak": peak_mib(), "grew": peak_mib() - before}}))
"""


def sandbox_python() -> Path:
    sys.path.insert(0, str(REPO / "src"))
    from coderunner.config import load_settings

    return load_settings().sandbox_env / "bin" / "python"


def child(python: Path, lib: Path, body: str, memory_mb: int) -> dict:
    script = PRELUDE + body
    limit = memory_mb * 1024 * 1024

    def limit_memory() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(lib), "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(lib)}  # fmt: skip
    done = subprocess.run(
        [str(python), "-c", script], env=env, capture_output=True, text=True, timeout=900, preexec_fn=limit_memory
    )
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size-mb", type=int, default=500)
    parser.add_argument("--memory-mb", type=int, default=2048)
    args = parser.parse_args()
    python = sandbox_python()
    n = args.size_mb * 1024 * 1024 // 8
    work = Path(tempfile.mkdtemp(prefix="bench-guest-snapshot-"))
    lib = work / "lib"
    lib.mkdir()
    (lib / "coderunner_guest").symlink_to(GUEST)
    lanes: dict[str, dict[str, list[dict]]] = {}
    try:
        for _ in range(args.rounds):
            for lane in ("snapshot-array", "snapshot-frame", "np-save"):
                state = str(work / "state")
                shutil.rmtree(state, ignore_errors=True)
                if lane == "np-save":
                    os.makedirs(state)
                    saved = child(
                        python, lib, NP_SAVE.format(make=MAKE["array"].format(n=n), state=state), args.memory_mb
                    )
                    loaded = child(python, lib, NP_LOAD.format(state=state), args.memory_mb)
                else:
                    kind = lane.split("-")[1]
                    make = MAKE[kind].format(n=n)
                    imports = make.splitlines()[0]
                    saved = child(python, lib, SNAPSHOT_SAVE.format(make=make, state=state), args.memory_mb)
                    loaded = child(python, lib, SNAPSHOT_LOAD.format(imports=imports, state=state), args.memory_mb)
                runs = lanes.setdefault(lane, {"save": [], "load": []})
                runs["save"].append(saved)
                runs["load"].append(loaded)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.size_mb} MiB of data, {args.rounds} rounds, address space limited to {args.memory_mb} MiB")
    print("peak: the process's peak RSS; +: what the save or load added to the peak before it (MiB)")
    print(f"{'lane':<16}{'save s':>9}{'peak':>7}{'+':>6}{'load s':>9}{'peak':>7}{'+':>6}")
    for lane, runs in lanes.items():
        cells = []
        for step in ("save", "load"):
            good = [run for run in runs[step] if "error" not in run]
            if len(good) < len(runs[step]):
                errors = [run["error"] for run in runs[step] if "error" in run]
                print(f"{lane} {step} failed: {errors[0]}")
            if good:
                cells.append(f"{statistics.median(r['s'] for r in good):>9.2f}")
                cells.append(f"{max(r['peak'] for r in good):>7.0f}")
                cells.append(f"{max(r['grew'] for r in good):>6.0f}")
            else:
                cells += [f"{'-':>9}", f"{'-':>7}", f"{'-':>6}"]
        print(f"{lane:<16}" + "".join(cells))


if __name__ == "__main__":
    main()
