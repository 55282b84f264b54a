"""What users get from the README's install: extras that cover imports, types that checkers see."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.timeout(240)


def _extra_requirements(extra: str) -> set[str]:
    names = set()
    for text in importlib.metadata.requires("infinibatch_like") or []:
        requirement = Requirement(text)
        if requirement.marker is not None and requirement.marker.evaluate({"extra": extra}):
            names.add(requirement.name)
    return names


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`args` run by this Python in `cwd`, seeing only the installed package (not the
    repository through PYTHONPATH or MYPYPATH)."""
    hidden = ("PYTHONPATH", "MYPYPATH")
    env = {key: value for key, value in os.environ.items() if key not in hidden}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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
