"""What a fresh machine installs is what the code imports.

Every top-level module imported anywhere in the project is either the standard library's, the
project's own, or provided by a distribution that ``pyproject.toml`` declares for that part of
the tree. A test follows the project modules it imports (``tests.*``, ``benchmarks.*``, ...), so
an undeclared import in a benchmark that a test uses fails here too.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCAL_PACKAGES = {"acco_hooks", "benchmarks", "tests", "examples", "train_titan"}


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(*extras: str) -> set[str]:
    """The distributions ``pyproject.toml`` installs with these extras, on this platform."""
    requirements = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        requirements += PYPROJECT["project"]["optional-dependencies"][extra]
    names = set()
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate():
            names.add(_normalize(requirement.name))
    return names


def _module_file(module: str) -> pathlib.Path | None:
    """The project file of a dotted module name, or None if it is not the project's."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(path: pathlib.Path, follow_local: bool) -> dict[str, pathlib.Path]:
    """Top-level third-party modules imported by ``path`` -> the file that imports each.

    With ``follow_local``, the project modules it imports are read too (transitively).
    """
    found: dict[str, pathlib.Path] = {}
    todo, seen = [path], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for node in ast.walk(ast.parse(current.read_text(), filename=str(current))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in LOCAL_PACKAGES:
                    local = _module_file(module)
                    if follow_local and local is not None:
                        todo.append(local)
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, current)
    return found


def undeclared(path: pathlib.Path, allowed: set[str], follow_local: bool) -> list[str]:
    """``module (imported by file)`` for every import no allowed distribution provides."""
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(imports_of(path, follow_local).items()):
        distributions = {_normalize(d) for d in providers.get(module, [])}
        if not distributions & allowed:
            what = ", ".join(sorted(distributions)) or "no installed distribution"
            shown = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where
            problems.append(f"{module} ({what}; imported by {shown})")
    return problems


def _files(*parts: str) -> list[pathlib.Path]:
    files = []
    for part in parts:
        path = ROOT / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


@pytest.mark.parametrize(
    ("trees", "extras"),
    [
        (("acco_hooks", "train_titan.py", "examples"), ()),
        (("benchmarks",), ("test", "docs")),
        (("tests",), ("test",)),
    ],
    ids=["runtime", "benchmarks", "tests"],
)
def test_every_import_is_declared_in_pyproject(trees: tuple[str, ...], extras: tuple[str, ...]):
    allowed = declared(*extras)
    follow_local = trees == ("tests",)  # what a test imports must install with the test extra
    problems = [p for f in _files(*trees) for p in undeclared(f, allowed, follow_local)]
    extra_hint = f" or optional-dependencies {list(extras)}" if extras else ""
    assert not problems, (
        f"imports not declared in pyproject.toml's dependencies{extra_hint}: " + "; ".join(problems)
    )


def test_an_undeclared_import_is_reported(tmp_path: pathlib.Path) -> None:
    # yaml is installed here (a dependency of a dependency) but declared by nobody.
    source = tmp_path / "uses_yaml.py"
    source.write_text("import os\nimport torch\n\ndef load():\n    import yaml\n")
    assert importlib.metadata.packages_distributions().get("yaml"), "pyyaml must be installed"
    found = imports_of(source, follow_local=False)
    assert set(found) == {"torch", "yaml"}
    problems = [p.split(" ")[0] for p in undeclared(source, declared(), follow_local=False)]
    assert problems == ["yaml"]


def test_a_test_that_imports_a_benchmark_needs_the_benchmark_imports_declared() -> None:
    # tests import benchmarks.convergence.plot, which imports matplotlib: followed, and found
    found = imports_of(ROOT / "tests" / "test_convergence_script.py", follow_local=True)
    assert "matplotlib" in found
    assert "matplotlib" in declared("test")
