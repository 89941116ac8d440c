"""The package's metadata: what installing flexfa pulls in and declares."""
import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirement(name: str, requirements: list[str]) -> str | None:
    return next((r for r in requirements if re.match(rf"{name}\b", r)), None)


def test_installing_flexfa_never_changes_numpy():
    """Only Triton's CPU interpreter needs numpy < 2.3: the library must not pin it (a user
    with a newer numpy would be downgraded); the interpret and test extras do."""
    assert _requirement("numpy", PROJECT["project"]["dependencies"]) is None
    extras = PROJECT["project"]["optional-dependencies"]
    assert _requirement("numpy", extras["interpret"]) == "numpy<2.3"
    assert _requirement("numpy", extras["test"]) == "numpy<2.3"


def test_torch_floor_is_one_that_pairs_with_the_triton_floor():
    """torch 2.5-2.7 pin Triton 3.1-3.3, so 'torch>=2.5' with 'triton>=3.4' was unsatisfiable
    there; torch 2.8 pins Triton 3.4."""
    dependencies = PROJECT["project"]["dependencies"]
    assert _requirement("torch", dependencies) == "torch>=2.8"
    assert _requirement("triton", dependencies) == "triton>=3.4"


def test_license_is_an_spdx_expression_with_its_file():
    project = PROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    # PEP 639: a license classifier next to a license expression is an error in setuptools
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    requires = PROJECT["build-system"]["requires"]
    assert "setuptools>=77" in requires, "older setuptools rejects a license expression"


def test_no_wheels_or_archives_committed_at_the_root():
    assert not [p.name for p in REPO.glob("*.whl")] + [p.name for p in REPO.glob("*.tar.gz")]


def test_the_version_flexfa_reports_is_the_packages():
    import flexfa

    assert PROJECT["project"]["version"] == flexfa.__version__
