"""What a fresh machine installs is what the code imports, and the library is lean and inert.

* Every top-level module imported anywhere in the project is the standard library's, the
  project's own, or provided by a distribution that ``pyproject.toml`` declares for that part of
  the tree: the engine and its torch front-ends need torch alone, ``acco_hooks.titan`` the
  ``titan`` extra, ``acco_hooks.hf`` the ``hf`` extra, the sum over torchft replica groups
  (``engine/replicas.py``, when given a manager) the ``ft`` extra, the checkout's main job,
  examples and scaffolding those three, the benchmarks ``bench``, the tests ``test``. A test follows the
  project modules it imports, so an undeclared import in a benchmark that a test uses fails
  here too.
* ``import acco_hooks`` imports neither torchtitan nor transformers, and importing any
  ``acco_hooks`` module, or building an engine, changes nothing in torch or torchtitan.
* The wheel holds the library and its job configs (package data), not the checkout's
  scaffolding, and the configs work from it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCAL_PACKAGES = {"acco_hooks", "benchmarks", "tests", "examples", "scaffolding", "train_titan"}


def _normalize(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(*extras: str) -> set[str]:
    """The distributions ``pyproject.toml`` installs with these extras, on this platform (an
    extra that names ``acco_hooks[...]`` brings those extras too)."""
    requirements = [Requirement(line) for line in PYPROJECT["project"]["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in PYPROJECT["project"]["optional-dependencies"][extra]:
            requirement = Requirement(line)
            if requirement.name == "acco_hooks":
                todo += sorted(requirement.extras)
            else:
                requirements.append(requirement)
    return {_normalize(r.name) for r in requirements if r.marker is None or r.marker.evaluate()}


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


def _files(*parts: str, without: tuple[str, ...] = ()) -> list[pathlib.Path]:
    files = []
    for part in parts:
        path = ROOT / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [f for f in files if not any(f.is_relative_to(ROOT / w) for w in without)]


@pytest.mark.parametrize(
    ("trees", "without", "extras"),
    [
        (("acco_hooks",), ("acco_hooks/titan", "acco_hooks/hf", "acco_hooks/engine/replicas.py"),
         ()),
        (("acco_hooks/titan",), ("acco_hooks/titan/replica_groups.py",), ("titan",)),
        (("acco_hooks/hf",), (), ("hf",)),
        # torchft, imported when an engine is given a manager (the error names the extra), and
        # by torchtitan's [fault_tolerance] (refused without it, naming the extra)
        (("acco_hooks/engine/replicas.py",), (), ("ft",)),
        (("acco_hooks/titan/replica_groups.py",), (), ("titan", "ft")),
        (("train_titan.py", "scaffolding", "examples"), (), ("titan", "hf", "ft")),
        (("benchmarks",), (), ("bench",)),
        (("tests",), (), ("test",)),
    ],
    ids=["engine", "titan", "hf", "torchft", "titan-torchft", "checkout", "benchmarks", "tests"],
)
def test_every_import_is_declared_in_pyproject(trees, without, extras) -> None:
    allowed = declared(*extras)
    follow_local = trees == ("tests",)  # what a test imports must install with the test extra
    problems = [p for f in _files(*trees, without=without)
                for p in undeclared(f, allowed, follow_local)]  # fmt: skip
    extra_hint = f" or optional-dependencies {list(extras)}" if extras else ""
    assert not problems, (
        f"imports not declared in pyproject.toml's dependencies{extra_hint}: " + "; ".join(problems)
    )


def test_a_plain_install_needs_torch_alone() -> None:
    assert declared() == {"torch"}
    frameworks = {"torchtitan", "transformers"}
    assert frameworks & declared("titan", "hf") == frameworks


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
    found = imports_of(ROOT / "tests" / "benchmarks" / "test_convergence_script.py",
                       follow_local=True)  # fmt: skip
    assert "matplotlib" in found
    assert "matplotlib" in declared("test")


def _python(code: str, *args: str, cwd: pathlib.Path = ROOT, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_acco_hooks_imports_no_trainer_framework() -> None:
    out = _python("""
        import sys, acco_hooks, acco_hooks.engine, acco_hooks.engine.advisor, acco_hooks.checkpoint
        print([m for m in sys.modules if m.split(".")[0] in ("torchtitan", "transformers",
                                                             "accelerate", "datasets")])
    """)
    assert out.strip() == "[]"


def test_import_acco_hooks_leaves_dtensor_and_fsdp_unimported_until_the_user_does() -> None:
    """2.2 s of CPU per process otherwise (every rank of every job). A DTensor parameter and
    a fully_shard model still take the DTensor and FSDP paths once their modules are in."""
    out = _python("""
        import sys, acco_hooks, acco_hooks.engine, acco_hooks.checkpoint, acco_hooks.fsdp
        from acco_hooks.engine.buffers import is_dtensor
        heavy = ("torch.distributed.tensor", "torch.distributed.fsdp")
        print([m for m in heavy if m in sys.modules])
        import torch
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        model = fully_shard(torch.nn.Linear(2, 2), mesh=mesh)
        print(len(acco_hooks.fsdp.fsdp_modules([model])), is_dtensor(model.weight),
              is_dtensor(torch.zeros(1)))
        dist.destroy_process_group()
    """)
    assert out.split("\n")[:2] == ["[]", "1 True False"], out


def _library_modules() -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "acco_hooks").rglob("*.py")
    )


@pytest.mark.titan
def test_importing_acco_hooks_changes_nothing_in_torch_or_torchtitan(tmp_path) -> None:
    """Import everything the library's modules import first, take a picture of every attribute
    of every torch and torchtitan module, import the library, and compare; then an engine
    replaces nothing either, and torch's clip_grad_norm_ on its parameters is refused."""
    from acco_hooks.titan import TITAN_030

    other_release = ("acco_hooks.titan.v022",)
    if not TITAN_030:
        other_release = ("acco_hooks.titan.v030", "acco_hooks.titan.config_registry")
    modules = [m for m in _library_modules() if m not in other_release]
    out = _python(f"""
        import importlib, json, sys
        modules = {modules!r}
        for name in modules:
            importlib.import_module(name)
        print(json.dumps(sorted(m for m in sys.modules if not m.startswith("acco_hooks"))))
    """)
    needed = tmp_path / "needed.json"
    needed.write_text(out.splitlines()[-1])
    out = _python(f"""
        import importlib, json, sys
        for name in json.load(open(sys.argv[1])):
            try:
                importlib.import_module(name)
            except Exception:
                pass
        def picture():
            return {{(m, k): id(v) for m, mod in list(sys.modules.items())
                    if m.split(".")[0] in ("torch", "torchtitan") and mod is not None
                    for k, v in list(vars(mod).items())}}
        before = picture()
        for name in {modules!r}:
            importlib.import_module(name)
        after = picture()
        modules_before = {{m for m, _ in before}}
        changed = sorted(f"{{m}}.{{k}}" for (m, k), i in after.items()
                         if m in modules_before and before.get((m, k)) != i)
        print("changed:", changed)

        import torch
        from acco_hooks import ACCOOptimizer
        original = torch.nn.utils.clip_grad_norm_
        model = torch.nn.Linear(3, 2)
        opt = ACCOOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        assert torch.nn.utils.clip_grad_norm_ is original   # an engine replaces nothing either
        model(torch.randn(2, 3)).sum().backward()
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        except RuntimeError as exc:   # refused by what .grad holds, not by a wrapper
            assert "max_grad_norm=" in str(exc)
        else:
            raise AssertionError("clip_grad_norm_ on an engine's parameters was not refused")
        opt.step()
        opt.close()
        print("guard: ok")
    """, str(needed))
    assert "changed: []" in out, out
    assert "guard: ok" in out


def test_the_wheel_holds_the_library_and_its_configs(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("acco_hooks-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.startswith("acco_hooks/titan/configs/")}
    assert {f"acco_hooks/titan/configs/{p.name}" for p in
            (ROOT / "acco_hooks" / "titan" / "configs").glob("*.toml")} == shipped  # fmt: skip
    assert not [n for n in names if n.startswith(("scaffolding/", "tests/", "examples/",
                                                  "benchmarks/")) or "cpu_shim" in n]  # fmt: skip
    requires = [Requirement(line.removeprefix("Requires-Dist:")) for line in zipfile.ZipFile(
        wheel).read(next(n for n in names if n.endswith("METADATA"))).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line]  # fmt: skip
    # torch only, in the tested range (tests/test_versions.py: the range the check at start uses)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [str(r) for r in requires] == [str(Requirement(d)) for d in declared] and [
        r.name for r in requires] == ["torch"], requires  # fmt: skip


@pytest.mark.titan
def test_the_shipped_configs_load_from_an_installed_wheel(tmp_path: pathlib.Path) -> None:
    """Installed into a folder of its own and imported from outside the checkout: every shipped
    config is found as package data and parses with the [acco] section."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                           "--no-build-isolation", "--target", str(site), str(ROOT)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = _python("""
        import importlib.resources, pathlib
        import acco_hooks
        from acco_hooks.titan import TITAN_030
        assert "site" in acco_hooks.__file__, acco_hooks.__file__
        configs = importlib.resources.files("acco_hooks.titan") / "configs"
        names = sorted(p.name.removesuffix(".toml") for p in configs.iterdir())
        if TITAN_030:
            import acco_hooks.titan.config_registry as registry
            assert list(registry.CONFIG_NAMES) == names
            for name in names:
                if not name.startswith("debug_cpu"):   # those need the checkout's corpus
                    config = getattr(registry, name)()
                    assert ("titan_" not in name) == hasattr(config, "acco"), name
        else:
            from torchtitan.config import ConfigManager
            from acco_hooks.titan.v022 import JobConfig
            for name in names:
                path = str(configs / f"{name}.toml")
                config = ConfigManager(JobConfig).parse_args(["--job.config_file", path])
                assert config.acco.enable == ("titan_" not in name), name
        print("configs:", len(names))
    """, cwd=tmp_path, PYTHONPATH=str(site))
    assert f"configs: {len(list((ROOT / 'acco_hooks/titan/configs').glob('*.toml')))}" in out


def test_the_tree_passes_the_projects_lint_config() -> None:
    """ruff, at the version the test extra pins, with pyproject.toml's ``[tool.ruff.lint]``."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           "--output-format", "concise", str(ROOT)],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
