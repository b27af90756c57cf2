"""One-shot runs and syntax checks, inside a throwaway sandbox (no kernel).

    python -c 'from coderunner_guest import oneshot; oneshot.main()' run LANGUAGE SOURCE VARIABLES_JSON MEMORY_MB
    python -c 'from coderunner_guest import oneshot; oneshot.main()' check LANGUAGE SOURCE
    python -c 'from coderunner_guest import oneshot; oneshot.main()' wait INPUTS_DIR MEMORY_MB STDIN_FD

The host writes the source and the variables (JSON) as files; they reach the program as data:
Python globals, JavaScript globals (set by a preload before the program runs). Nothing is ever
pasted into source text. `check` prints one JSON object. Bash runs without this launcher (the host
starts it directly, or it waited beside `wait`; its variables come from a file bash sources).

A Python run pays for every import here before the user's first line, so only os and sys are
imported up front (an empty VARIABLES_JSON means none: no json either), and the host starts
this with -c rather than -m (runpy costs a few ms). `wait` is a sandbox started ahead of its
program (see OneShotRunner.ready), the coprocess of a waiting bash (coderunner/oneshot/program.py:
READY_WAITER): it reads the language from the first line of stdin (bash's pipe, which never says
bash: that runs in bash itself), takes STDIN_FD as the program's stdin, then runs INPUTS_DIR/main.*
as `run` would.
"""

import os
import sys

NODE = "/usr/bin/node"
BASH = "/bin/bash"
PRELOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preload.cjs")
#: The JavaScript preload finds the variables file through this and removes it from the environment.
VARIABLES_ENV = "CODERUNNER_VARIABLES_FILE"
CHECK_TIMEOUT_S = 30


def _variables(path):
    if not path:
        return {}
    import json

    with open(path, encoding="utf-8") as handle:
        variables = json.load(handle)
    if not isinstance(variables, dict) or not all(isinstance(name, str) and name.isidentifier() for name in variables):
        raise SystemExit("coderunner: bad variables file")  # the host validated them; never expected
    return variables


def _lift_address_space_limit():
    """V8 reserves far more address space than it uses: where the memory cgroup bounds real use
    (the hard RLIMIT_AS is then unlimited), drop the soft limit for Node itself."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        return True
    return False


def run_python(source, variables):
    from . import caches, user_paths

    user_paths()  # only now: this interpreter started with -P (sandbox/common.py: product_python)
    caches.seed()  # matplotlib's font list from setup: a run that charts does not rebuild it
    with open(source, encoding="utf-8") as handle:
        code = compile(handle.read(), os.path.basename(source), "exec")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, **variables}
    sys.argv = [os.path.basename(source)]
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        # The user's frames only: drop this launcher's own.
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        sys.exit(1)


def run_javascript(source, variables_path, memory_mb):
    argv = [NODE]
    if _lift_address_space_limit() and memory_mb:
        argv.append(f"--max-old-space-size={max(int(memory_mb * 3 // 4), 64)}")
    argv += ["--require", PRELOAD, source]
    from . import user_paths

    user_paths()  # the Python programs this one starts see the session's packages on PYTHONPATH
    os.execve(NODE, argv, {**os.environ, VARIABLES_ENV: variables_path})


def check(language, source):
    """Syntax errors as [{line, column, message}]; column is None where the tool gives none."""
    import subprocess

    if language == "python":
        with open(source, encoding="utf-8") as handle:
            text = handle.read()
        try:
            compile(text, os.path.basename(source), "exec", dont_inherit=True)
        except SyntaxError as exc:
            return [{"line": exc.lineno, "column": exc.offset, "message": exc.msg}]
        return []
    if language == "javascript":
        _lift_address_space_limit()
        done = subprocess.run([NODE, "--check", source], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        return [] if done.returncode == 0 else _node_errors(done.stderr, source)
    done = subprocess.run([BASH, "-n", source], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    return [] if done.returncode == 0 else _bash_errors(done.stderr, source)


def _node_errors(stderr, source):
    """node --check prints 'FILE:LINE', the line, a caret line, then 'SyntaxError: message'."""
    import re

    lines = stderr.splitlines()
    line = column = None
    message = next((text for text in lines if re.match(r"\w*Error:", text)), stderr.strip()[-500:])
    for index, text in enumerate(lines):
        found = re.match(re.escape(source) + r":(\d+)\s*$", text)
        if found:
            line = int(found.group(1))
            if index + 2 < len(lines) and "^" in lines[index + 2]:
                column = lines[index + 2].index("^") + 1
            break
    return [{"line": line, "column": column, "message": message}]


def _bash_errors(stderr, source):
    """bash -n gives 'FILE: line N: message' and no column."""
    import re

    errors = []
    for text in stderr.splitlines():
        found = re.match(re.escape(source) + r": line (\d+): (.*)", text)
        if found:
            errors.append({"line": int(found.group(1)), "column": None, "message": found.group(2)})
    return errors or [{"line": None, "column": None, "message": stderr.strip()[-500:]}]


def versions():
    """What each language runs on, as the sandbox sees it."""
    import subprocess

    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for language, argv in (("javascript", [NODE, "--version"]), ("bash", [BASH, "--version"])):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
            found[language] = done.stdout.splitlines()[0].strip() if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, IndexError):
            found[language] = None
    return found


#: A sandbox started ahead learns its language from one line (its waiting bash passes on stdin's first).
MAX_HEADER_BYTES = 64
SOURCES = {"python": "main.py", "javascript": "main.js"}


def _header():
    """The first line of fd 0, read a byte at a time so that nothing of what follows is consumed."""
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte or len(line) >= MAX_HEADER_BYTES:
            raise SystemExit("coderunner: no program was sent")
        line += byte
    return line.decode("ascii", "replace").strip()


#: Written to stdout once this interpreter is up: the host takes it before the program's output.
READY = b"R"


def wait(inputs, memory_mb, stdin_fd):
    """Started before the program is known (same sandbox, same limits); runs it once told to."""
    os.write(1, READY)
    language = _header()
    if language not in ("python", "javascript"):
        raise SystemExit(f"coderunner: unknown language {language!r}")
    os.dup2(stdin_fd, 0)  # the program's stdin, from where its language line ended
    os.close(stdin_fd)
    source = os.path.join(inputs, SOURCES[language])
    variables = os.path.join(inputs, "variables.json")
    if language == "python":
        run_python(source, _variables(variables if os.path.exists(variables) else ""))
    else:
        _variables(variables)
        run_javascript(source, variables, memory_mb)


def main(argv=None):
    argv = sys.argv if argv is None else argv
    if argv[1] == "wait":
        wait(argv[2], int(argv[3]), int(argv[4]))
        return
    if argv[1] == "versions":
        import json

        _lift_address_space_limit()
        print(json.dumps(versions()))
        return
    command, language, source = argv[1:4]
    if command == "check":
        import json

        print(json.dumps({"errors": check(language, source)}))
        return
    variables_path = argv[4]
    memory_mb = int(argv[5]) if len(argv) > 5 else 0
    if language == "python":
        run_python(source, _variables(variables_path))
    elif language == "javascript":
        _variables(variables_path)
        run_javascript(source, variables_path, memory_mb)
    else:
        raise SystemExit(f"coderunner: no launcher for {language}")  # bash starts without one


if __name__ == "__main__":
    main(sys.argv)
