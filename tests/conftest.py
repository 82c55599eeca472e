"""Shared tiny-model fixtures (float64, random weights, eval mode; seeded).

The models themselves live in ``tests/models.py`` (importable as ``models`` from any test);
these fixtures give the common model + batches combinations so tests need not rebuild
them.  Models are function-scoped (a test may move or perturb its copy).

One intra-op thread per test process (and, through the environment, per process a test
starts: ranks, notebook kernels, ``dvc``): the models are tiny, so a second thread buys
nothing and, beside ``pytest -n 2``'s other worker or a busy machine, its OpenMP spin-waits
cost many times the work (tests that need another thread count set it themselves)."""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from tests.models import MHAClassifier, bert_batch, tiny_bert  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """The ``slow`` tests first (a stable sort, the same order in every xdist worker): under
    ``make test``'s ``-n 2 --dist loadfile`` the files holding the long tests are handed out
    first and the short ones fill in around them, instead of one long file finishing the run
    alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def mha_batches(n: int = 2, size: int = 5, seq: int = 4, dim: int = 12, seed: int = 0):
    """``n`` batches ``(x, y)`` for :class:`models.MHAClassifier` (float64 inputs, 3 classes)."""
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(seed + s)
        out.append((torch.randn(size, seq, dim, generator=g, dtype=torch.float64),
                    torch.randint(0, 3, (size,), generator=g)))
    return out


@pytest.fixture
def mha_model():
    """``nn.MultiheadAttention`` classifier: 12 wide, 3 heads (packed in-projection)."""
    return MHAClassifier()


@pytest.fixture
def mha_data():
    """Two batches for :func:`mha_model`."""
    return mha_batches()


@pytest.fixture
def bert_model():
    """Two-layer HF BERT, hidden 16, 4 heads, float64."""
    return tiny_bert()


@pytest.fixture
def bert_data():
    """Two batches for :func:`bert_model` (with a padded sequence)."""
    return [bert_batch(seed=s) for s in range(2)]


@pytest.fixture
def float64_default():
    """Every tensor the test creates is float64 (the default dtype restored afterwards)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
