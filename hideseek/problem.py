"""The sharpness problem: one engine behind every entry point.

A :class:`SharpnessProblem` is one model, its batches and a measure, validated, with the
settings of the computation (:class:`Settings`).  It owns every step of a measurement, each
written once:

* **validation** — the settings (:meth:`Settings.check`), the model, the perturbed
  parameters, the batches (:mod:`hideseek.inputs`);
* **the set-up pass** (:meth:`SharpnessProblem.set_up`) — loss and gradient at θ on the
  first batch, the deterministic-loss check, symmetry discovery, the geometry
  (docs/maths.md §6–7); the gradient is Auto-PGD's start on the first batch
  (:meth:`SharpnessProblem.take_start`);
* **the seed rule** (:meth:`SharpnessProblem.generator`): batch ``i``'s random draws come
  from one generator seeded by ``(seed, i)`` alone;
* **evaluating a point** (:meth:`SharpnessProblem.objective`, a :class:`BatchObjective`);
* **one batch's search** (:meth:`SharpnessProblem.measure_batch`) and **assembling the
  result** (:meth:`SharpnessProblem.result`, a :class:`SharpnessResult`).

:func:`hideseek.sharpness` is :meth:`SharpnessProblem.run`; :func:`hideseek.sharpness_zoo`
builds one problem per member and advances their searches in lockstep; on several ranks
:mod:`hideseek.distributed` drives the same object.  Every entry point takes the keywords of
:class:`Settings` plus the measure's keyword form (:data:`MEASURE_KEYWORDS`) and refuses an
unknown one in one line (:func:`resolve`).

The code lives in :mod:`hideseek.engine`, one module per responsibility (settings, checks,
loss, result, engine, backends); this module re-exports its public names at their old place.
"""
from .engine.checks import CORRECTION_BOUND, SATURATION
from .engine.engine import SharpnessProblem
from .engine.loss import BatchObjective
from .engine.result import BatchRecord, SharpnessResult, norm_share
from .engine.settings import KEYWORDS, LOW_MEMORY_FROM, MEASURE_KEYWORDS, TRIM_FROM, Settings, resolve, \
    seeded_generator
from .progress import with_progress  # noqa: F401 (re-exported, its old place)

__all__ = ["BatchObjective", "BatchRecord", "CORRECTION_BOUND", "KEYWORDS", "LOW_MEMORY_FROM", "MEASURE_KEYWORDS",
           "SATURATION", "Settings", "SharpnessProblem", "SharpnessResult", "TRIM_FROM", "norm_share", "resolve",
           "seeded_generator", "with_progress"]
