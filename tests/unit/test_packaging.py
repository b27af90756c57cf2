"""pyproject's requires-python against what the pinned dependencies themselves require.

A pin that needs a newer Python than we declare makes `pip install` fail on a Python we claim to
support; this reads each pin's Requires-Python from the installed metadata, so a bump that raises
one is caught here rather than on a user's machine.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def project() -> dict:
    with PYPROJECT.open("rb") as handle:
        return tomllib.load(handle)["project"]


def floor(requires_python: str) -> Version:
    """The lowest version `>=X` admits: what we promise to install on."""
    lows = [Version(spec.version) for spec in SpecifierSet(requires_python) if spec.operator == ">="]
    assert len(lows) == 1, f"requires-python {requires_python!r} should have exactly one >= bound"
    return lows[0]


def pins() -> list[Requirement]:
    table = project()
    texts = [*table["dependencies"], *(text for group in table["optional-dependencies"].values() for text in group)]
    return [Requirement(text) for text in texts]


def test_every_pin_installs_on_our_oldest_python() -> None:
    oldest = floor(project()["requires-python"])
    environment = {"python_version": f"{oldest.major}.{oldest.minor}", "python_full_version": str(oldest)}
    checked, refused = [], []
    for pin in pins():
        if pin.marker is not None and not pin.marker.evaluate(environment):
            continue  # not installed on our oldest Python at all
        needs = importlib.metadata.metadata(pin.name).get("Requires-Python")
        checked.append(pin.name)
        if needs and not SpecifierSet(needs).contains(oldest, prereleases=True):
            refused.append(f"{pin.name} needs Python {needs}")
    assert checked, "no pinned dependency was checked"
    assert not refused, f"requires-python says >={oldest}, but: {', '.join(refused)}"


def test_every_pin_is_exact() -> None:
    """The check above reads the installed metadata: it speaks for the pin only if the pin is exact."""
    loose = [str(pin) for pin in pins() if [spec.operator for spec in pin.specifier] != ["=="]]
    assert not loose, loose


def test_the_floor_reads_a_lone_lower_bound() -> None:
    assert floor(">=3.11") == Version("3.11")
