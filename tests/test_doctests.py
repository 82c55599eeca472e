"""Every public name of the library has a reference entry with an example, and every example runs.

The public names: ``hideseek.__all__``, the optimizers of ``hideseek.optim`` and the Hugging Face
trainer ``hideseek.optim.hf.SAMTrainer``. Each must have at least one doctest example in its own
docstring that is not skipped (``# doctest: +SKIP`` marks illustrative call shapes on models the
reader has, and does not count), each example must pass, and each name must have an entry
(``::: path``) on a page of the API reference (``docs/reference/``, rendered by ``make docs``).
"""
from __future__ import annotations

import doctest
import importlib
import inspect
import re

import pytest

import hideseek
from tests import ROOT

EXTRA = ("optim.SAM", "optim.frozen_norm_stats", "optim.hf.SAMTrainer")
PUBLIC = sorted(hideseek.__all__) + list(EXTRA)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def public_object(name: str):
    obj = hideseek
    for i, part in enumerate(name.split(".")):
        if not hasattr(obj, part):                      # a submodule imported on demand (optim.hf)
            importlib.import_module(".".join(["hideseek", *name.split(".")[:i + 1]]))
        obj = getattr(obj, part)
    return obj


def own_doctest(name: str) -> doctest.DocTest:
    """The doctest of the name's own docstring (not its members')."""
    obj = public_object(name)
    module = obj if inspect.ismodule(obj) else inspect.getmodule(inspect.unwrap(obj))
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, module=module, globs={})
    assert len(tests) == 1, f"{name}: no docstring"
    return tests[0]


def runnable(test: doctest.DocTest) -> list[doctest.Example]:
    return [ex for ex in test.examples if not ex.options.get(doctest.SKIP)]


def test_the_public_names_are_the_documented_ones():
    # hideseek.__all__ may grow: each new name needs an example here and an entry in the reference
    assert {"sharpness", "Measure", "RiemannianHessian", "suggest_rho", "optim"} <= set(hideseek.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_a_runnable_example(name):
    test = own_doctest(name)
    checks = [ex for ex in runnable(test) if ex.want.strip()]
    assert checks, (f"{name}: its docstring has no example that runs and shows a result (an Examples "
                    f"section with >>> lines, not all marked +SKIP)")


@pytest.mark.parametrize("name", PUBLIC)
def test_every_example_passes(name):
    test = own_doctest(name)
    runner = doctest.DocTestRunner(optionflags=FLAGS, verbose=False)
    out: list[str] = []
    result = runner.run(test, out=out.append)
    assert result.failed == 0, "".join(out)
    assert result.attempted >= 1


def reference_entries() -> dict[str, str]:
    """``::: path`` entries of docs/reference/*.md -> the page."""
    out = {}
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for path in re.findall(r"^:::\s*(\S+)", page.read_text(encoding="utf-8"), re.M):
            out[path] = page.name
    return out


def _resolve(path: str):
    module, _, attr = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        return getattr(importlib.import_module(module), attr)


def test_every_public_name_has_a_reference_entry():
    entries = reference_entries()
    documented = {id(_resolve(path)) for path in entries}
    missing = [name for name in PUBLIC if id(public_object(name)) not in documented]
    assert not missing, f"no `::: …` entry in docs/reference/ for: {missing}"
    assert "hideseek.cli" in entries                   # the command line has its page too


def test_the_checker_sees_a_missing_or_skipped_example():
    def documented():
        """A function.

        >>> documented()                             # doctest: +SKIP
        """

    test = doctest.DocTestFinder(recurse=False).find(documented, "documented", globs={})[0]
    assert len(test.examples) == 1 and runnable(test) == []
