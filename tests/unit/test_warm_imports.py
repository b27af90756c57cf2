"""What a preloaded kernel checks before it is handed over (guest/warm_imports.py still_current): that the user's
imports would find the same modules. Only entries the preload did not search (the workspace, the session's
packages) are listed; a preloaded name found in one is searched for again in full."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coderunner.guest import warm_imports


@pytest.fixture
def preloaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """json as a preloaded module, every entry of today's sys.path searched, and a writable folder put first."""
    assert json.__spec__ is not None
    monkeypatch.setattr(warm_imports, "_loaded", {"json": json.__spec__.origin})
    monkeypatch.setattr(warm_imports, "_searched", set(sys.path))
    monkeypatch.setattr(warm_imports, "_rc", None)
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    monkeypatch.setattr(sys, "path", [str(workspace), *sys.path])
    yield workspace


def test_a_folder_with_other_names_only_is_current(preloaded: Path) -> None:
    (preloaded / "notes.txt").write_text("")
    (preloaded / "analysis.py").write_text("")
    warm_imports.still_current()


def test_a_module_of_a_preloaded_name_in_the_workspace_is_not(preloaded: Path) -> None:
    (preloaded / "json.py").write_text("shadowed = True")
    with pytest.raises(ImportError, match=r"json would now be imported from .*workspace/json\.py"):
        warm_imports.still_current()


def test_a_package_or_an_extension_of_that_name_is_not_either(preloaded: Path) -> None:
    (preloaded / "json.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    with pytest.raises(ImportError, match="json would now be imported"):
        warm_imports.still_current()


def test_a_folder_of_that_name_without_init_is_searched_and_found_current(preloaded: Path) -> None:
    (preloaded / "json").mkdir()  # a namespace portion: the regular package further on still wins
    warm_imports.still_current()


def test_an_entry_that_cannot_be_listed_means_every_name_is_searched(preloaded: Path, tmp_path: Path) -> None:
    archive = tmp_path / "modules.zip"
    archive.write_bytes(b"")  # not a folder: no listing; a full search still finds the same json
    sys.path.insert(0, str(archive))
    warm_imports.still_current()
    sys.path.insert(0, str(preloaded))
    (preloaded / "json.py").write_text("")
    with pytest.raises(ImportError):
        warm_imports.still_current()


def test_no_name_is_searched_for_when_no_listed_entry_has_one(preloaded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.machinery import PathFinder

    searched: list[str] = []
    find_spec = PathFinder.find_spec

    def counted(name: str, path: object = None, target: object = None) -> object:
        searched.append(name)
        return find_spec(name, path, target)  # type: ignore[arg-type]

    monkeypatch.setattr(PathFinder, "find_spec", counted)
    (preloaded / "data.csv").write_text("")
    warm_imports.still_current()
    assert searched == []
    (preloaded / "json.py").write_text("")
    with pytest.raises(ImportError):
        warm_imports.still_current()
    assert searched == ["json"]
