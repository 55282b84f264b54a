"""The package root: every public name of the library's core packages is importable from
it, under a sorted ``__all__``, and importing it does not import torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import infinibatch_like
import infinibatch_like.iterators as it

CORE_PACKAGES = ["stages", "background", "distributed", "checkpoint", "testing"]


def test_the_root_all_is_sorted_and_every_name_resolves() -> None:
    assert infinibatch_like.__all__ == sorted(infinibatch_like.__all__)
    missing = [name for name in infinibatch_like.__all__ if not hasattr(infinibatch_like, name)]
    assert missing == []


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_every_public_name_of_a_core_package_is_in_the_root(package: str) -> None:
    module = importlib.import_module(f"infinibatch_like.{package}")
    assert module.__all__ == sorted(module.__all__)
    absent = sorted(set(module.__all__) - set(infinibatch_like.__all__))
    assert absent == [], f"infinibatch_like.{package} exports names the root lacks: {absent}"
    for name in module.__all__:
        assert getattr(infinibatch_like, name) is getattr(module, name)


def test_every_iterator_of_the_compatible_face_is_in_the_root() -> None:
    iterators = {
        name
        for name in it.__all__
        if getattr(getattr(it, name), "__module__", "").startswith("infinibatch_like.")
    }
    assert "ParallelMapIterator" in iterators
    assert iterators - set(infinibatch_like.__all__) == set()


def test_importing_the_root_imports_neither_torch_nor_an_optional_extra() -> None:
    code = (
        "import sys, infinibatch_like; "
        "print(sorted(m for m in ('torch', 'numpy', 'fsspec', 'pyarrow', 'cloudpickle') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
