"""The test suite, a package so that test files in different folders may share a basename.

Layout: ``tests/hideseek/`` mirrors ``hideseek/`` (``geometry/``, ``symmetries/``, ``optim/``),
``tests/companion/`` mirrors ``companion/`` (``assets/``, ``experiments/``; the notebooks run through
the pipeline in ``notebooks/``), ``tests/benchmarks/`` mirrors ``benchmarks/``; this level holds only
the checks of the repository as a whole (docs, ``dvc.yaml``, packaging). Shared helpers:
``tests.models`` (tiny models), ``tests/conftest.py`` (fixtures), ``ROOT``; checked-in fixture files
sit in ``tests/data/`` and ``tests/fixtures/``."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""
