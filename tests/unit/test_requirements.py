"""install_packages takes requirement specifiers only: never a pip option, a path or a URL."""

from __future__ import annotations

import pytest

from coderunner.policy.requirements import MAX_PACKAGES, PackagesError, check_requirements


@pytest.mark.parametrize(
    "package", ["requests", "pandas>=2,<3", "httpx==0.28.1", "black[jupyter]", "zope.interface~=6.0", "a_b-c!=1.*"]
)
def test_specifiers_are_accepted(package: str) -> None:
    assert check_requirements([package]) == [package]


@pytest.mark.parametrize(
    "package",
    [
        "-r requirements.txt",
        "--index-url=http://mirror.invalid/simple",
        "./local-package",
        "/abs/path.whl",
        "git+https://example.invalid/x.git",
        "pkg @ https://example.invalid/pkg.whl",
        "two words",
        "",
        "-e.",
    ],
)
def test_options_paths_and_urls_are_refused_naming_the_entry(package: str) -> None:
    with pytest.raises(PackagesError, match="is not a requirement specifier"):
        check_requirements(["requests", package])


def test_none_or_too_many_is_refused() -> None:
    with pytest.raises(PackagesError, match="name at least one package"):
        check_requirements([])
    with pytest.raises(PackagesError, match=f"at most {MAX_PACKAGES} packages"):
        check_requirements([f"p{i}" for i in range(MAX_PACKAGES + 1)])
