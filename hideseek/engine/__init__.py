"""The engine behind every entry point, one module per responsibility.

* :mod:`hideseek.engine.settings` — the keywords every entry point takes (:class:`~hideseek.engine.settings.Settings`,
  :func:`~hideseek.engine.settings.resolve`), their checks, the seed rule and the memory thresholds;
* :mod:`hideseek.engine.checks` — the model, the perturbed parameters and the symmetry blocks
  checked, and the warnings about a result;
* :mod:`hideseek.engine.loss` — the set-up pass and the loss on one batch as a function of the
  perturbation (:class:`~hideseek.engine.loss.BatchObjective`);
* :mod:`hideseek.engine.result` — :class:`~hideseek.engine.result.SharpnessResult`, the per-batch
  :class:`~hideseek.engine.result.BatchRecord` and the norm accounting;
* :mod:`hideseek.engine.engine` — what set-up gives, the immutable
  :class:`~hideseek.engine.engine.Prepared`: one batch's search with the restart rule, the batch
  loop, the result;
* :mod:`hideseek.engine.problem` — :class:`~hideseek.engine.problem.SharpnessProblem`: the
  validated model, batches, measure and executor;
* :mod:`hideseek.engine.backends` — the executors behind one protocol (local, data-parallel,
  sharded; the zoo's lockstep in :mod:`hideseek.zoo`).

:mod:`hideseek.problem` re-exports the public names at their old place.
"""
