"""The executors behind one protocol (hideseek/engine/backends.py, issue 32 item 3).

* One registry: the three built-in executors are there, and a call outside a process group
  gets the one-process executor.
* A new executor is one module plus its registration (docs/architecture.md, "Adding an
  executor"): the module of the diff there, loaded from the docs as written, runs ``SharpnessProblem.run`` through the
  engine's one set-up, batch loop and restart rule, and gives the one-process values bit for
  bit (the reference: ``hs.sharpness`` without it).
* The engine never asks which executor it has.
"""
import importlib.util
import warnings
from pathlib import Path

import pytest

import hideseek as hs
from hideseek.engine.backends import BACKENDS, Backend, backend_for
from tests import ROOT
from tests.models import bert_batch, tiny_bert

ENGINE = Path(hs.__file__).resolve().parent / "engine"


def _documented_executor(tmp_path):
    """The module that docs/architecture.md's diff adds (``hideseek/engine/counting.py``), loaded
    from the docs as written (its registration runs on import)."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    diff = doc[doc.index("+++ b/hideseek/engine/counting.py"):]
    diff = diff[:diff.index("--- a/")]
    source = "\n".join(line[1:] for line in diff.splitlines()[2:] if line.startswith("+")) + "\n"
    path = tmp_path / "counting.py"
    path.write_text(source.replace("from .backends import", "from hideseek.engine.backends import"))
    spec = importlib.util.spec_from_file_location("hideseek_docs_counting", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CountingBackend


@pytest.fixture
def counting(tmp_path):
    try:
        yield _documented_executor(tmp_path)
    finally:
        BACKENDS.pop("counting", None)


def test_one_registry_holds_the_executors():
    assert {"none", "data", "sharded"} <= set(BACKENDS)
    assert type(backend_for(tiny_bert())) is BACKENDS["none"] is Backend


@pytest.mark.parametrize("kw", [dict(metric="mixed", restarts=2), dict(measure="adaptive", kind="average")])
def test_a_registered_executor_runs_the_engine_with_the_same_values(counting, kw):
    model, batches = tiny_bert(seed=3), [bert_batch(seed=s) for s in range(2)]
    kw = dict(rho=0.1, n_iters=3, progress=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = hs.sharpness(model, batches, **kw)
        model.count_evaluations = True
        problem = hs.SharpnessProblem(model, batches, **kw)
        got = problem.run()
    assert isinstance(problem.backend, counting) and got.parallel == "none"
    assert problem.backend.evaluations > 0
    assert got.per_batch == ref.per_batch and got.restart_values == ref.restart_values
    assert got.base_losses == ref.base_losses and got.norm_share == ref.norm_share


def test_the_engine_never_asks_which_executor_it_has():
    for name in ("engine.py", "problem.py"):
        src = (ENGINE / name).read_text()
        for ask in ("parallel ==", "parallel !=", ".name ==", "shards", "isinstance(self.backend"):
            assert ask not in src, f"hideseek/engine/{name} asks which executor it has ({ask!r})"
