"""Supported versions are the tested ones, declared once and refused clearly at start."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import acco_hooks
from acco_hooks import (
    SUPPORTED_VERSIONS,
    UnsupportedVersionError,
    UntestedVersionWarning,
    check_supported_versions,
)

ROOT = pathlib.Path(__file__).parents[1]


@pytest.fixture(autouse=True)
def _refusals_not_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the refusals: ACCO_HOOKS_UNTESTED_VERSIONS=1 must not weaken them."""
    monkeypatch.delenv("ACCO_HOOKS_UNTESTED_VERSIONS", raising=False)


def test_pyproject_declares_the_ranges_the_program_checks() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    titan = {Requirement(r).name: Requirement(r) for r in project["optional-dependencies"]["titan"]}
    ft = {Requirement(r).name: Requirement(r) for r in project["optional-dependencies"]["ft"]}

    def expected(name: str) -> SpecifierSet:
        low, high, _ = SUPPORTED_VERSIONS[name]
        if low == high:
            return SpecifierSet(f"=={low}")
        if high is None:
            return SpecifierSet(f">={low}")
        if high.count(".") == 1:  # "2.15" admits every 2.15.x, as the check at start does
            major, minor = high.split(".")
            return SpecifierSet(f">={low},<{major}.{int(minor) + 1}")
        return SpecifierSet(f">={low},<={high}")

    assert SpecifierSet(project["requires-python"]) == expected("python")
    assert requirements["torch"].specifier == expected("torch")
    assert titan["torchtitan"].specifier == expected("torchtitan")
    assert ft["torchft"].specifier == expected("torchft")


@pytest.mark.parametrize(
    ("name", "version"),
    [("python", "3.11.7"), ("python", "3.13.0"), ("torch", "2.13.0+cpu"), ("torch", "2.13.0"),
     ("torch", "2.14.0.dev20261101+cu128"), ("torch", "2.15.0+cu132"), ("torch", "2.15.1"),
     ("torchtitan", "0.2.2"), ("torchtitan", "0.3.0"), ("torchft", "0.2.0")],
)  # fmt: skip
def test_supported_versions_pass(name: str, version: str) -> None:
    check_supported_versions(**{name: version})


@pytest.mark.parametrize(("torch", "torchtitan"), [("2.13.0", "0.2.2"), ("2.15.0+cu132", "0.3.0")])
def test_tested_torch_and_torchtitan_pairs_pass(torch: str, torchtitan: str) -> None:
    check_supported_versions(torch=torch, torchtitan=torchtitan)


def test_torchtitan_030_on_torch_214_is_refused_naming_the_pair() -> None:
    with pytest.raises(UnsupportedVersionError) as error:
        check_supported_versions(torch="2.14.1", torchtitan="0.3.0")
    assert "torch 2.14.1 with torchtitan 0.3.0 (supported: torch>=2.15 with torchtitan==0.3.0)" in (
        str(error.value)
    )
    assert "ACCO_TITAN=0.3.0 bash scripts/setup.sh" in str(error.value)


@pytest.mark.parametrize(
    ("name", "version", "fix"),
    [("python", "3.10.13", "python3.11"), ("torch", "2.6.0", "pip install 'torch==2.13.0'"),
     ("torch", "2.12.1+cu126", "pip install 'torch==2.13.0'"),
     ("torch", "2.16.0", "'torch==2.15.0' with torchtitan 0.3.0"),
     ("torchtitan", "0.3.1", "pip install 'torchtitan==0.2.2'"),
     ("torchtitan", "0.2.3", "ACCO_TITAN=0.3.0 bash scripts/setup.sh"),
     ("torchtitan", "0.2.1", "pip install 'torchtitan==0.2.2'")],
)  # fmt: skip
def test_unsupported_version_is_refused_naming_version_range_and_fix(
    name: str, version: str, fix: str
) -> None:
    with pytest.raises(UnsupportedVersionError) as error:
        check_supported_versions(**{name: version})
    message = str(error.value)
    assert f"{name} {version}" in message
    assert f"supported: {name}" in message
    assert fix in message


def test_every_unsupported_version_is_named_in_one_error() -> None:
    with pytest.raises(UnsupportedVersionError, match=r"torch 2\.6\.0.*; and torchtitan 0\.3\.1"):
        check_supported_versions(python="3.11.7", torch="2.6.0", torchtitan="0.3.1")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip


def test_import_refuses_an_unsupported_torch() -> None:
    proc = _run("import torch; torch.__version__ = '2.6.0'; import acco_hooks")
    assert proc.returncode != 0
    assert "UnsupportedVersionError: acco_hooks does not support the installed torch 2.6.0" in (
        proc.stderr
    )


@pytest.mark.titan
def test_train_titan_refuses_an_unsupported_torchtitan_before_any_process_group() -> None:
    code = (
        "import sys, runpy, torchtitan, torch.distributed as dist\n"
        "torchtitan.__version__ = '0.3.1'\n"
        "sys.argv = ['train_titan.py', '--job.config_file', "
        "'torchtitan_configs/debug_cpu_acco.toml']\n"
        "try:\n"
        "    runpy.run_path('train_titan.py', run_name='__main__')\n"
        "finally:\n"
        "    print('process group formed:', dist.is_initialized())\n"
    )
    proc = _run(code)
    assert proc.returncode != 0
    assert "installed torchtitan 0.3.1 (supported: torchtitan==0.2.2 or ==0.3.0)" in proc.stderr
    assert "process group formed: False" in proc.stdout


@pytest.mark.titan
def test_the_installed_versions_are_supported() -> None:
    import torch
    import torchtitan

    check_supported_versions(torch=torch.__version__, torchtitan=torchtitan.__version__)
    assert acco_hooks.__version__


@pytest.mark.titan
def test_the_other_releases_adapter_refuses_to_import_naming_what_to_use() -> None:
    from acco_hooks.titan import TITAN_030

    other, release = ("acco_hooks.titan.v022", "0.2.2") if TITAN_030 else (
        "acco_hooks.titan.v030", "0.3.0")  # fmt: skip
    proc = _run(f"import {other}")
    assert proc.returncode != 0
    assert f"ImportError: {other} is the torchtitan {release} adapter" in proc.stderr
    assert "or train_titan.py (any release)" in proc.stderr


def test_untested_versions_env_turns_the_refusal_into_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For a GPU image whose torch cannot be changed; the default stays a refusal."""
    with pytest.raises(UnsupportedVersionError, match="ACCO_HOOKS_UNTESTED_VERSIONS=1"):
        check_supported_versions(torch="2.11.0+cu130")
    monkeypatch.setenv("ACCO_HOOKS_UNTESTED_VERSIONS", "1")
    with pytest.warns(UntestedVersionWarning, match=r"torch 2\.11\.0\+cu130.*untested"):
        check_supported_versions(torch="2.11.0+cu130")
    monkeypatch.setenv("ACCO_HOOKS_UNTESTED_VERSIONS", "yes")  # only "1" opts in
    with pytest.raises(UnsupportedVersionError):
        check_supported_versions(torch="2.11.0+cu130")
