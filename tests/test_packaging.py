"""A package others can ship: the license, its metadata, an sdist whose tests
run, and `help(filtx)` pointing at nothing that is missing."""

import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import filtx

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_license_metadata_in_the_current_form():
    """An SPDX expression and `license-files` (PEP 639), which setuptools reads
    from 77 on without a deprecation warning; the installed metadata says the
    same."""
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639
    requires = pyproject()["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(7[7-9]|[89]\d|\d{3,})(\.\d+)*", r) for r in requires)
    metadata = importlib.metadata.metadata("filtx")
    assert metadata["License-Expression"] == "Apache-2.0"


def test_classifiers_and_typing_marker():
    classifiers = pyproject()["project"]["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert (ROOT / "filtx" / "py.typed").exists()


def test_sdist_carries_what_the_tests_need():
    """MANIFEST.in takes the test suite with its conftest and helpers, the
    benchmark suites it collects, the docs pages and examples it runs."""
    lines = (ROOT / "MANIFEST.in").read_text().splitlines()
    directives = {
        (words[0], name)
        for words in (line.split() for line in lines if line.strip() and not line.startswith("#"))
        for name in words[1:]
    }
    for folder in ("tests", "benchmarks", "docs", "examples"):
        assert ("graft", folder) in directives, folder
    for name in ("LICENSE", "README.md", "mkdocs.yml"):
        assert ("include", name) in directives, name
    assert ("recursive-include", "README.md") in directives  # the layers' READMEs (filtx/*/README.md)
    testpaths = pyproject()["tool"]["pytest"]["ini_options"]["testpaths"]
    assert all((ROOT / path).is_dir() for path in testpaths), testpaths
    assert all(path.split("/")[0] in {"tests", "benchmarks"} for path in testpaths)  # grafted above


def test_help_names_no_missing_file():
    """Every file that `filtx`'s docstring names exists in the repository (or in
    the sdist, which carries docs/, examples/ and benchmarks/)."""
    named = re.findall(r"[\w./-]+\.(?:md|py|toml|yml|txt)\b", filtx.__doc__ or "")
    missing = [
        name for name in named
        if not any((base / name).exists() for base in (ROOT, ROOT / "docs", ROOT / "filtx"))
    ]
    assert not missing, f"help(filtx) names files that do not exist: {missing}"


def test_version_is_the_released_one_everywhere():
    """One version, written once in pyproject.toml: the installed metadata and
    `filtx.__version__` say it (an editable install made before a bump fails here:
    `pip install -e .` again), and the changelog's newest release is it."""
    declared = pyproject()["project"]["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", declared), declared
    assert importlib.metadata.version("filtx") == declared
    assert filtx.__version__ == declared
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## (.+)$", changelog, flags=re.MULTILINE)
    assert headings[0] == "Unreleased", headings[:2]
    newest = re.fullmatch(r"(\d+\.\d+\.\d+) \((\d{4}-\d{2}-\d{2})\)", headings[1])
    assert newest, f"the newest release heading reads {headings[1]!r}, not 'X.Y.Z (YYYY-MM-DD)'"
    assert newest.group(1) == declared
    releases = [h.split()[0] for h in headings[1:]]
    as_tuples = [tuple(map(int, v.split("."))) for v in releases]
    assert as_tuples == sorted(as_tuples, reverse=True), releases  # newest first


def test_version_of_a_source_tree_not_installed():
    """Without metadata (the checkout on sys.path, filtx not installed),
    `filtx.__version__` is read from the checkout's pyproject.toml."""
    code = (
        "import importlib.metadata as m\n"
        "def version(name):\n"
        "    raise m.PackageNotFoundError(name)\n"
        "m.version = version\n"
        "import filtx\n"
        "print(filtx.__version__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == pyproject()["project"]["version"]
