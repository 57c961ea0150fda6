"""Every module's docstring examples (``>>>``) run and print what they say, so a usage example
cannot drift from the code. Examples that need processes, files or a GPU are marked
``# doctest: +SKIP`` where they stand."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("engine", "partitioner", "experiments")


def _modules() -> list[str]:
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        path = importlib.import_module(pkg).__path__
        names += [m.name for m in pkgutil.walk_packages(path, prefix=pkg + ".")]
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             report=True, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"


def test_the_examples_are_found() -> None:
    """The run above is not vacuous: the packages' docstrings hold examples that execute."""
    attempted = sum(doctest.testmod(importlib.import_module(n), optionflags=doctest.ELLIPSIS).attempted
                    for n in ("engine.comm", "experiments.bench.report", "partitioner.costs"))
    assert attempted >= 3
