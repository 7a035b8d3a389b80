"""The Python, torch and torchtitan versions acco_hooks is tested with, checked at import.

The ranges are the ones CI runs (``pyproject.toml`` declares the same; a test keeps the two in
step). A version outside them fails at ``import acco_hooks`` (Python, torch) or ``import
acco_hooks.titan`` (torchtitan): before any process group forms, with one error that names the
installed version, the supported range and the command that fixes it, instead of a confusing
failure deep inside a collective or a config parser.

``ACCO_HOOKS_UNTESTED_VERSIONS=1`` turns that error into a warning, for a machine whose torch
cannot be changed (a GPU image with its own CUDA build of torch): the run is then untested.
"""

from __future__ import annotations

import os
import platform
import re
import warnings

__all__ = ["SUPPORTED_VERSIONS", "TORCHTITAN_RELEASES", "UNTESTED_VERSIONS_ENV",
           "UnsupportedVersionError", "UntestedVersionWarning", "check_supported_versions"]

# name -> (lowest supported, highest supported or None, the fix to print)
SUPPORTED_VERSIONS: dict[str, tuple[str, str | None, str]] = {
    "python": ("3.11", None, "create the virtual environment with python3.11 or newer"),
    # CI runs torch 2.13.0 (with torchtitan 0.2.2) and 2.15.0 (with 0.3.0): 2.15.x is the newest.
    "torch": ("2.13", "2.15", "pip install 'torch==2.13.0' (scripts/setup.sh does it), or "
              "'torch==2.15.0' with torchtitan 0.3.0"),
    # torchtitan changes its config and trainer APIs between releases (0.3.0 replaced the TOML
    # job configs): only the releases the integration is tested against are accepted, each
    # with the lowest torch CI runs it on (TORCHTITAN_RELEASES).
    "torchtitan": ("0.2.2", "0.3.0",
                   "pip install 'torchtitan==0.2.2' (scripts/setup.sh does it), or "
                   "ACCO_TITAN=0.3.0 bash scripts/setup.sh for torchtitan 0.3.0 with torch 2.15"),
    # torchft's Manager and lighthouse (manager=): the release CI runs, every 0.2.x
    "torchft": ("0.2.0", "0.2", "pip install 'acco_hooks[ft]' (torchft 0.2)"),
}  # fmt: skip

# torchtitan release -> the lowest torch it is tested with (CI: 2.13.0 and 2.15.0)
TORCHTITAN_RELEASES: dict[str, str] = {"0.2.2": "2.13", "0.3.0": "2.15"}


# Set to 1 to run on versions outside the tested ranges (a warning instead of the error).
UNTESTED_VERSIONS_ENV = "ACCO_HOOKS_UNTESTED_VERSIONS"


class UnsupportedVersionError(RuntimeError):
    """A Python, torch, torchtitan or torchft outside the range acco_hooks supports."""


class UntestedVersionWarning(UserWarning):
    """Running on a version outside the tested ranges, as ``ACCO_HOOKS_UNTESTED_VERSIONS=1`` asks."""


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; local and pre-release tags are ignored."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def _within(version: str, low: str, high: str | None) -> bool:
    release = _release(version)
    if release < _release(low):
        return False
    # A high bound of "0.2.2" admits 0.2.2.post1 but not 0.2.3: compare the bound's length only.
    return high is None or release[: len(_release(high))] <= _release(high)


def _titan_release(version: str) -> str | None:
    """The supported torchtitan release ``version`` is (post releases count), else None."""
    for release in TORCHTITAN_RELEASES:
        if _release(version)[:3] == _release(release):
            return release
    return None


def check_supported_versions(**installed: str | None) -> None:
    """Raise :class:`UnsupportedVersionError` if any given version is outside its range.

    Args:
        **installed: ``python=``, ``torch=``, ``torchtitan=``, ``torchft=``: the installed
            version strings.
            ``None`` skips a check (e.g. torchtitan when it is not used).

    Raises:
        UnsupportedVersionError: naming every version out of range, its supported range and
            the fix, in one message. With ``ACCO_HOOKS_UNTESTED_VERSIONS=1`` in the
            environment the same message is an :class:`UntestedVersionWarning` instead.

    Example::

        >>> check_supported_versions(torch="2.6.0")
        Traceback (most recent call last):
        ...
        UnsupportedVersionError: acco_hooks does not support the installed torch 2.6.0 ...
    """
    problems = []
    torch = installed.get("torch")
    for name, version in installed.items():
        if version is None:
            continue
        low, high, fix = SUPPORTED_VERSIONS[name]
        if name == "torchtitan":
            release = _titan_release(version)
            if release is None:
                wanted = " or ".join(f"=={r}" for r in TORCHTITAN_RELEASES)
                problems.append(f"{name} {version} (supported: {name}{wanted}); fix: {fix}")
            elif torch is not None and not _within(torch, TORCHTITAN_RELEASES[release], None):
                floor = TORCHTITAN_RELEASES[release]
                problems.append(
                    f"torch {torch} with torchtitan {version} (supported: torch>={floor} with "
                    f"torchtitan=={release}); fix: {fix}"
                )
            continue
        if not _within(version, low, high):
            wanted = f"=={low}" if high == low else f">={low}" + (f",<={high}" if high else "")
            problems.append(f"{name} {version} (supported: {name}{wanted}); fix: {fix}")
    if not problems:
        return
    message = "acco_hooks does not support the installed " + "; and ".join(problems)
    if os.environ.get(UNTESTED_VERSIONS_ENV) == "1":
        warnings.warn(
            f"{message}. Running anyway, untested, because {UNTESTED_VERSIONS_ENV}=1",
            UntestedVersionWarning, stacklevel=2,
        )  # fmt: skip
        return
    raise UnsupportedVersionError(
        f"{message} (to run on it untested anyway: {UNTESTED_VERSIONS_ENV}=1)"
    )


def check_python_and_torch() -> None:
    """Check the running Python, then the installed torch (imported only after the first)."""
    check_supported_versions(python=platform.python_version())
    import torch

    check_supported_versions(torch=torch.__version__)
