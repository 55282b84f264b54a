"""What users get from the README's install: extras that cover imports, types that checkers see."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _python import run_python
from packaging.requirements import Requirement

pytestmark = pytest.mark.timeout(240)


def _extra_requirements(extra: str) -> set[str]:
    names = set()
    for text in importlib.metadata.requires("infinibatch_like") or []:
        requirement = Requirement(text)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}):
            names.add(requirement.name)
    return names


def _requirements(distribution: str, extras: frozenset[str]) -> list[Requirement]:
    """The requirements of an installed `distribution` that apply with `extras` asked for."""
    applying = []
    for text in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras or {""}):
            applying.append(requirement)
    return applying


def _installed_closure(distribution: str, extras: frozenset[str]) -> set[str]:
    """Normalised names of the distributions that `pip install distribution[extras]` installs."""
    visited: set[tuple[str, frozenset[str]]] = set()
    pending = [(distribution, extras)]
    while pending:
        name, wanted = pending.pop()
        for requirement in _requirements(name, wanted):
            step = (requirement.name, frozenset(requirement.extras))
            if step not in visited:
                visited.add(step)
                pending.append(step)
    return {name.lower().replace("_", "-") for name, _ in visited}


def _third_party_imports(paths: list[Path]) -> set[str]:
    """Top-level module names imported by `paths` that are neither standard library nor local."""
    repo = Path(__file__).resolve().parents[2]
    local = {path.stem for path in [*paths, *(repo / "bench").glob("*.py")]} | {"infinibatch_like"}
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.partition(".")[0])
    return names - local - set(sys.stdlib_module_names) - {"__future__"}


def test_every_requirement_of_every_extra_has_an_upper_bound() -> None:
    unbounded = []
    for text in importlib.metadata.requires("infinibatch_like") or []:
        requirement = Requirement(text)
        operators = {spec.operator for spec in requirement.specifier}
        if not operators & {"<", "<=", "==", "~="}:
            unbounded.append(text)
    assert unbounded == [], f"requirements without an upper bound: {unbounded}"


def test_test_extra_installs_every_package_the_tests_and_tutorials_import() -> None:
    repo = Path(__file__).resolve().parents[2]
    files = sorted((repo / "test").rglob("*.py")) + sorted((repo / "tutorials").glob("*.py"))
    installed = _installed_closure("infinibatch_like", frozenset({"test"}))
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in sorted(_third_party_imports(files)):
        names = {name.lower().replace("_", "-") for name in providers.get(module, [module])}
        if not names & installed:
            undeclared[module] = sorted(names)
    assert undeclared == {}, f"imported by the tests but not installed by [test]: {undeclared}"


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`args` run by this Python in `cwd`, seeing only the installed package (not the
    repository through PYTHONPATH or MYPYPATH)."""
    hidden = ("PYTHONPATH", "MYPYPATH")
    env = {key: value for key, value in os.environ.items() if key not in hidden}
    return run_python(args, cwd, timeout, env)


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run(["-c", textwrap.dedent(code)], cwd, 120)


def test_torch_extra_declares_what_infinibatch_like_torch_imports() -> None:
    assert {"torch", "numpy"} <= _extra_requirements("torch")


@pytest.mark.parametrize(
    ("missing", "name", "feature"),
    [
        ("numpy", "pad_batch", "infinibatch_like.torch.pad_batch"),
        ("torch", "CheckpointableDataset", "infinibatch_like.torch.CheckpointableDataset"),
    ],
)
def test_torch_subpackage_imports_without_its_extra_and_names_it(
    missing: str, name: str, feature: str, tmp_path: Path
) -> None:
    proc = _python(
        f"""
        import sys
        sys.modules[{missing!r}] = None  # as if it were not installed
        import infinibatch_like.torch
        try:
            infinibatch_like.torch.{name}
        except ModuleNotFoundError as error:
            print(error)
        else:
            raise SystemExit("{name} imported without {missing}")
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{feature} needs the package {missing!r}" in proc.stdout
    assert "pip install 'infinibatch_like[torch]'" in proc.stdout


@pytest.mark.slow
def test_type_checkers_see_the_installed_package(tmp_path: Path) -> None:
    """A user's script, outside the repository, type-checks against the installed package:
    a correct script passes and a wrong one is caught (so the types are really seen)."""
    (tmp_path / "good.py").write_text(
        textwrap.dedent(
            """
            from infinibatch_like.datasets import chunked_dataset_iterator
            from infinibatch_like.iterators import MapIterator

            def read(path: str) -> list[str]:
                return [path]

            lengths = MapIterator(chunked_dataset_iterator(["a"], read, buffer_size=4), len)
            first: int = next(lengths)
            """
        )
    )
    (tmp_path / "bad.py").write_text(
        textwrap.dedent(
            """
            from infinibatch_like.iterators import FixedBatchIterator

            FixedBatchIterator([1, 2, 3], batch_size="4")
            """
        )
    )
    def mypy(name: str) -> subprocess.CompletedProcess[str]:
        return _run(["-m", "mypy", "--strict", "--no-incremental", name], tmp_path, 200)

    good = mypy("good.py")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = mypy("bad.py")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert 'incompatible type "list[int]"' in bad.stdout
    assert 'incompatible type "str"' in bad.stdout
