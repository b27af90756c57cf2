"""Errors that name the fix, the pure parts: argument parsing and the words of a refusal (issue 28).

The paths a model takes are in test_e2e_error_texts.py; here each rule on its own, with no sandbox.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import TypeAdapter

from coderunner.errors import GuestCallError
from coderunner.hostfs.sandbox_files import FileAccessError
from coderunner.hostfs.transfers import export_target, import_source
from coderunner.snapshots.records import Listing, SnapshotMeta
from coderunner.snapshots.store import SnapshotNotFound
from coderunner.tools.arguments import Pages
from coderunner.tools.browser import absolute_url, checked_url, file_path
from coderunner.tools.documents import called_as
from coderunner.tools.snapshots import named


def test_pages_take_a_number_or_a_list_of_numbers_and_the_schema_stays_text() -> None:
    pages = TypeAdapter(Pages)
    assert pages.validate_python(2) == "2" and pages.validate_python([1, 3]) == "1,3"
    assert pages.validate_python("1-3,5") == "1-3,5" and pages.validate_python(None) == ""
    assert pages.json_schema() == {"type": "string", "description": "e.g. 1-3,5"}
    with pytest.raises(ValueError, match="valid string"):
        pages.validate_python(True)  # a flag is not a page


def test_a_guest_failure_names_the_tool_once() -> None:
    said = called_as("pdf_ops: pdf_ops merge needs inputs (it takes: inputs)", "pdf_ops", "pdf_ops")
    assert said == "pdf_ops: merge needs inputs (it takes: inputs)"
    assert called_as("browser: could not load x", "browser", "browser_navigate") == "browser_navigate: could not load x"
    assert called_as("pdf_ops did not complete: x", "pdf_ops", "pdf_ops") == "pdf_ops did not complete: x"


def test_navigate_needs_an_absolute_url() -> None:
    for url in ("http://127.0.0.1:8000/", "https://example.com", "file:///workspace/a.html", "about:blank"):
        assert absolute_url(url), url
    for url in ("index.html", "example.com", "localhost:8000/x", "/workspace/a.html", "//example.com"):
        assert not absolute_url(url), url
        with pytest.raises(GuestCallError, match=r"needs an absolute URL \(http://\.\.\., https://"):
            checked_url(url)


def test_a_file_url_names_a_sandbox_path_for_the_session_to_confine() -> None:
    assert file_path("file:///workspace/a%20b.html") == "/workspace/a b.html"
    assert file_path("file://localhost/workspace/x.html") == "/workspace/x.html"
    assert file_path("https://example.com/") is None
    with pytest.raises(GuestCallError, match=r"names a file in the sandbox, not on 'evil\.example'"):
        file_path("file://evil.example/etc/passwd")


def test_a_relative_upload_starts_in_the_only_import_folder_else_the_folders_are_named(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    found = import_source([first], "notes.txt")
    assert found.host_path(found.path) == first / "notes.txt"
    with pytest.raises(FileAccessError, match="outside the folders allowed"):
        import_source([first], "../second/notes.txt")
    with pytest.raises(FileAccessError) as several:
        import_source([first, second], "notes.txt")
    assert f"give its full path in one of {first}, {second}" in str(several.value)
    with pytest.raises(FileAccessError, match=r"no import folder is configured \(import_dirs\)"):
        import_source([], "notes.txt")


def test_a_refusal_about_an_export_names_the_host_folder_not_the_view(tmp_path: Path) -> None:
    target = export_target(tmp_path, "local", None, "report.csv")
    refused = FileAccessError(f"{target.path} already exists (pass overwrite=true)")
    assert str(target.in_host_words(refused)) == f"{target.root}/report.csv already exists (pass overwrite=true)"
    other = FileAccessError("/workspace/export/report.csv does not exist")
    assert str(target.in_host_words(other)) == str(other)  # a sandbox path that merely contains the word


def _meta(snapshot_id: str, name: str, created: float) -> SnapshotMeta:
    return SnapshotMeta(snapshot_id, "local", name, created, "snapshot", "abcd1234", "bwrap", {}, 0, 0, {})


def test_restore_by_name_takes_the_newest_and_a_miss_names_what_there_is() -> None:
    newest, older = _meta("s-newnewnewnew", "baseline", 2.0), _meta("s-oldoldoldold", "baseline", 1.0)
    found = Listing([newest, older, _meta("s-unnamedunnam", "", 0.5)], [])
    missing = SnapshotNotFound("no snapshot")
    assert named(found, "baseline", missing) is newest
    with pytest.raises(SnapshotNotFound) as miss:
        named(found, "baselin", missing)
    assert "'baselin'" in str(miss.value) and "'baseline' (s-newnewnewnew)" in str(miss.value)
    assert "s-unnamedunnam" in str(miss.value)
    with pytest.raises(SnapshotNotFound) as by_id:
        named(found, "s-abcdefghijkl", missing)  # an id that is not there: the store's own words
    assert by_id.value is missing
