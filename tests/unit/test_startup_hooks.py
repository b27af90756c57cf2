"""Start-up hooks in a reopened workspace, on a plain folder the test fills as an attacker would."""

from __future__ import annotations

import os
from pathlib import Path

from coderunner.kernel.startup_hooks import DISABLED_DIR, disable_startup_hooks


def _site(workspace: Path) -> Path:
    site = workspace / ".coderunner" / "site-packages"
    site.mkdir(parents=True)
    return site


def test_hooks_are_moved_aside_and_the_rest_reported(tmp_path: Path) -> None:
    site = _site(tmp_path)
    (site / "sitecustomize.py").write_text("raise SystemExit")
    (site / "usercustomize").mkdir()
    (site / "usercustomize" / "__init__.py").write_text("raise SystemExit")
    (site / "sitecustomize.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (site / "extra.pth").write_text("import os")
    (site / "requests").mkdir()
    (site / "requests-2.0.dist-info").mkdir()
    report = disable_startup_hooks(tmp_path)
    assert sorted(report.disabled) == [
        "sitecustomize.cpython-311-x86_64-linux-gnu.so", "sitecustomize.py", "usercustomize",
    ]  # fmt: skip
    assert report.inert_pth == ["extra.pth"] and report.packages == ["requests"]
    assert sorted(os.listdir(site)) == ["extra.pth", "requests", "requests-2.0.dist-info"]
    assert len(os.listdir(tmp_path / ".coderunner" / DISABLED_DIR)) == 3


def test_a_hook_that_is_a_link_is_moved_not_followed(tmp_path: Path) -> None:
    canary = tmp_path / "canary.py"
    canary.write_text("untouched")
    site = _site(tmp_path / "ws")
    os.symlink(canary, site / "sitecustomize.py")
    report = disable_startup_hooks(tmp_path / "ws")
    assert report.disabled == ["sitecustomize.py"]
    assert canary.read_text() == "untouched" and not (site / "sitecustomize.py").exists()


def test_a_linked_package_folder_is_moved_aside_whole(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "site-packages").mkdir(parents=True)
    (elsewhere / "site-packages" / "sitecustomize.py").write_text("raise SystemExit")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    os.symlink(elsewhere, workspace / ".coderunner")  # the sandbox would follow it on PYTHONPATH
    report = disable_startup_hooks(workspace)
    assert report.disabled and not (workspace / ".coderunner").exists()
    assert (elsewhere / "site-packages" / "sitecustomize.py").exists(), "the link's target is not touched"
    (workspace / ".coderunner").mkdir()
    os.symlink(elsewhere / "site-packages", workspace / ".coderunner" / "site-packages")
    report = disable_startup_hooks(workspace)
    assert report.disabled == ["site-packages (not a folder)"]
    assert not os.path.lexists(workspace / ".coderunner" / "site-packages")


def test_nothing_to_report_for_a_workspace_without_packages(tmp_path: Path) -> None:
    assert disable_startup_hooks(tmp_path).as_dict() is None


def test_modules_shadowing_the_stdlib_or_the_kernel_are_named(tmp_path: Path) -> None:
    """Harmless to the launch now (-P), but user code importing such a name may get the workspace's file."""
    for name in ("ipykernel_launcher.py", "json.py", "runpy.pyc", "zmq.cpython-311-x86_64-linux-gnu.so", "mine.py"):
        (tmp_path / name).write_text("open('/workspace/MARKER', 'a')")
    (tmp_path / "encodings").mkdir()
    (tmp_path / "encodings" / "__init__.py").write_text("")
    (tmp_path / "html").mkdir()  # a bare folder (a namespace package) never shadows a module
    (tmp_path / "traitlets").symlink_to(tmp_path / "encodings")  # named, never followed by the host
    report = disable_startup_hooks(tmp_path)
    assert report.shadowing == [
        "encodings/", "ipykernel_launcher.py", "json.py", "runpy.pyc", "traitlets (link)",
        "zmq.cpython-311-x86_64-linux-gnu.so",
    ]  # fmt: skip
    shown = report.as_dict()
    assert shown is not None and shown["shadowing"] == report.shadowing and "rename" in str(shown["shadowing_note"])


def test_a_workspace_of_ordinary_modules_reports_nothing(tmp_path: Path) -> None:
    (tmp_path / "analysis.py").write_text("")
    (tmp_path / "data").mkdir()
    assert disable_startup_hooks(tmp_path).as_dict() is None
