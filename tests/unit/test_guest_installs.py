"""What the kernel's %pip accepts and where `!` installs go (guest/installs.py), without a kernel.

The real thing (a kernel in a sandbox, its network, the package index) is tests/test_e2e_pip_magic.py.
"""

from __future__ import annotations

import pytest

from coderunner.guest.installs import PackageInstallError, install_words, parse_install, shell_magic


@pytest.mark.parametrize(
    ("command", "routed"),
    [
        ("pip install six", ("pip", "install six")),
        ("  pip3 install -q six==1.17.0 ", ("pip", "install -q six==1.17.0")),
        ("pip3.11 install six", ("pip", "install six")),
        ("python -m pip install -U {pkg}", ("pip", "install -U {pkg}")),
        ("/opt/coderunner/env/bin/python3 -m pip install six", ("pip", "install six")),
        ("{sys.executable} -m pip install six", ("pip", "install six")),
        ("pip install six && echo done", ("pip", "install six && echo done")),
        ("conda install numpy", ("conda", "conda install numpy")),
        ("micromamba install -y numpy", ("micromamba", "micromamba install -y numpy")),
        ("uv pip install numpy", ("uv", "uv pip install numpy")),
        ("uv add numpy", ("uv", "uv add numpy")),
    ],
)
def test_shell_installs_go_to_the_magic_that_installs_or_refuses(command: str, routed: tuple[str, str]) -> None:
    assert shell_magic(command) == routed


@pytest.mark.parametrize(
    "command",
    ["pip --version", "pip list", "pip show six", "ls pip install", "echo pip install six", "conda list", "uv --help",
     "pipx install black", "python script.py install"],
)  # fmt: skip
def test_other_shell_commands_are_left_to_the_shell(command: str) -> None:
    assert shell_magic(command) is None


def test_install_takes_what_install_packages_takes_and_quiet_or_upgrade() -> None:
    words = ["-q", "six==1.17.0", "-U", "pandas>=2,<3", "requests[socks]", "--no-cache-dir"]
    assert parse_install(words) == ["six==1.17.0", "pandas>=2,<3", "requests[socks]"]


@pytest.mark.parametrize(
    "words",
    [
        ["--index-url=http://mirror.invalid/simple", "six"],
        ["-i", "http://mirror.invalid/simple", "six"],
        ["-r", "requirements.txt"],
        ["-e", "."],
        ["git+https://example.org/x.git"],
        ["./local_dir"],
        ["six", "&&", "rm", "-rf", "/"],
        ["--target", "/tmp/x", "six"],
    ],
)
def test_options_paths_urls_and_shell_operators_are_refused_by_name(words: list[str]) -> None:
    with pytest.raises(PackageInstallError, match="takes package names") as refused:
        parse_install(words)
    assert words[0] in str(refused.value) or words[-1] in str(refused.value)


def test_nothing_to_install_or_too_much_is_refused() -> None:
    with pytest.raises(PackageInstallError, match="at least one package"):
        parse_install(["-q"])
    with pytest.raises(PackageInstallError, match="at most 32"):
        parse_install([f"p{n}" for n in range(33)])


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("install six", ["six"]),
        ("install -q 'pandas>=2' six  # for the table", ["-q", "pandas>=2", "six"]),
        ("install -q six > /dev/null 2>&1", ["-q", "six"]),
        ("install six &>/dev/null", ["six"]),
        ("install six > out.txt", ["six", ">", "out.txt"]),  # a real file: refused by parse_install
        ("list", None),
        ("show six", None),
        ("", None),
    ],
)
def test_a_percent_pip_line_is_an_install_or_left_to_pip(line: str, words: list[str] | None) -> None:
    assert install_words(line) == words


def test_an_unreadable_line_says_so() -> None:
    with pytest.raises(PackageInstallError, match="cannot read this pip command"):
        install_words("install 'six")
