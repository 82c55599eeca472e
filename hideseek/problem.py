"""The sharpness problem: one engine behind every entry point.

A :class:`SharpnessProblem` is one model, its batches and a measure, validated, with the
settings of the computation (:class:`Settings`) and its executor (a backend,
:mod:`hideseek.engine.backends`).  Every step of a measurement is written once:

* **validation** — the settings (:meth:`Settings.check`), the model, the perturbed
  parameters, the batches (:mod:`hideseek.inputs`, :mod:`hideseek.engine.checks`);
* **the set-up** (:meth:`SharpnessProblem.prepare`, by the executor) — loss and gradient at θ
  on the first batch, the deterministic-loss check, symmetry discovery, the geometry
  (docs/maths.md §6–7), into an immutable :class:`Prepared`; the set-up gradient is
  Auto-PGD's start on the first batch, which that batch's search consumes;
* **the seed rule** (:func:`seeded_generator`): batch ``i``'s random draws come from one
  generator seeded by ``(seed, i)`` alone;
* **evaluating a point** (the executor's ``evaluate``: a :class:`BatchObjective` in one
  process);
* **one batch's search with the restart rule** (:meth:`Prepared.measure_batch`), **the batch
  loop** (:func:`hideseek.engine.engine.batch_loop`) and **the result**
  (:meth:`Prepared.result`, a :class:`SharpnessResult`).

:func:`hideseek.sharpness` is :meth:`SharpnessProblem.run` (the executor's ``run``: one
process, data parallel or sharded); :func:`hideseek.sharpness_zoo` builds one problem per
member and runs them with the lockstep executor (:class:`hideseek.zoo.LockstepBackend`).
Every entry point takes the keywords of :class:`Settings` plus the measure's keyword form
(:data:`MEASURE_KEYWORDS`) and refuses an unknown one in one line (:func:`resolve`).

The code lives in :mod:`hideseek.engine`, one module per responsibility (settings, checks,
loss, result, engine, problem, backends); this module re-exports its public names at their
old place.
"""
from .engine.checks import CORRECTION_BOUND, SATURATION
from .engine.engine import Prepared
from .engine.loss import BatchObjective
from .engine.problem import SharpnessProblem
from .engine.result import BatchRecord, SharpnessResult, norm_share
from .engine.settings import KEYWORDS, LOW_MEMORY_FROM, MEASURE_KEYWORDS, TRIM_FROM, Settings, resolve, \
    seeded_generator
from .progress import with_progress  # noqa: F401 (re-exported, its old place)

__all__ = ["BatchObjective", "BatchRecord", "CORRECTION_BOUND", "KEYWORDS", "LOW_MEMORY_FROM", "MEASURE_KEYWORDS",
           "Prepared", "SATURATION", "Settings", "SharpnessProblem", "SharpnessResult", "TRIM_FROM", "norm_share",
           "resolve", "seeded_generator", "with_progress"]
