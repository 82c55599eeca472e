"""The companion's one worker pool: a module-level function over a list of tasks, here or in spawned processes.

Every parallel loop of the companion (training a zoo's members, measuring them) goes through
:func:`run_tasks`, the one place a process pool is made; :func:`run_pool` is its form for
``(name, item)`` pairs sharing one set of keyword arguments (``fn(name, item, **task)``), with the
workers' intra-op thread count and a progress bar.

The rules, the same for every caller:

* **Where.** In this process when ``workers == 1`` or there is at most one task; otherwise in
  ``min(workers, len(tasks))`` processes started with the ``spawn`` method (a fresh interpreter each:
  no state inherited from this process, the same on Linux and macOS).
* **Set-up.** ``initializer(*initargs)`` runs once in every process that runs tasks: in each worker
  before its first task, or here before the first call. A worker reads what it set up from a
  module-level global (the tasks then carry only what differs between them).
* **Order.** The results come back in the tasks' order, whatever order they finish in;
  ``on_result(index, result)`` is called as each arrives (in the parent, in completion order; here, in
  task order), e.g. to advance a progress bar.
* **Failure.** An exception raised by a task (or by ``on_result``) propagates, unchanged in type, after
  the tasks not yet started are cancelled.
* **What is sent.** ``fn``, ``initializer``, ``initargs`` and the tasks' arguments are pickled to the
  workers: functions must be module-level ones (or :func:`functools.partial` of them), not lambdas or
  local functions; :func:`check_picklable` turns a failure into one clear :class:`TypeError` before any
  process starts (checked on ``initargs`` and the first task).

Nothing here draws a random number, and the only thread count set is :func:`run_pool`'s (its
``threads`` here, this process's count in every worker), so a task's value is what the same call gives
in a serial loop under the same set-up.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["check_picklable", "run_pool", "run_tasks"]


def _check_workers(workers: object) -> int:
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise TypeError(f"workers must be a whole number >= 1 (1 runs here), got {workers!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}; use 1 to run the tasks in this process")
    return workers


def check_picklable(objects: Mapping[str, object], *, needs: str, fix: str) -> None:
    """Raise ``TypeError("{needs}; {name} is not ({error}); {fix}")`` for the first of ``objects``
    (``name -> object``) that :mod:`pickle` cannot send to a spawned worker; nothing when all can."""
    import pickle

    for name, obj in objects.items():
        try:
            pickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 (any pickling failure means the same thing here)
            raise TypeError(f"{needs}; {name} is not ({exc}); {fix}") from None


def run_tasks(fn: Callable[..., Any], tasks: Iterable[tuple], *, workers: int,
              initializer: Callable[..., None] | None = None, initargs: tuple = (),
              on_result: Callable[[int, Any], None] | None = None) -> list:
    """``[fn(*task) for task in tasks]``, in this process or in ``workers`` spawned ones (module docstring).

    Parameters
    ----------
    fn:
        a module-level function; called once per task.
    tasks:
        each a tuple of ``fn``'s positional arguments (one argument: ``(arg,)``).
    workers:
        1 runs the tasks here, one after another; ``n > 1`` in ``min(n, len(tasks))`` spawned
        processes (here too when there is only one task).
    initializer, initargs:
        ``initializer(*initargs)`` runs once in every process that runs tasks, this one included when
        they run here (e.g. to set the thread count and load what every task reads).
    on_result:
        ``on_result(index, result)`` for every task as its result arrives (``index`` into ``tasks``).

    Returns
    -------
    The results, ``result[i]`` of ``tasks[i]``.
    """
    _check_workers(workers)
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {fn!r}")
    if initializer is None and initargs:
        raise ValueError("initargs given without an initializer; pass initializer= too, or drop initargs")
    tasks = list(tasks)
    bad = [i for i, t in enumerate(tasks) if not isinstance(t, tuple)]
    if bad:
        raise TypeError(f"task {bad[0]} is {tasks[bad[0]]!r}: each task is a tuple of fn's positional arguments "
                        "(wrap a single argument as (arg,))")
    results: list = [None] * len(tasks)
    if workers == 1 or len(tasks) <= 1:
        if initializer is not None and tasks:
            initializer(*initargs)
        for i, args in enumerate(tasks):
            results[i] = fn(*args)
            if on_result is not None:
                on_result(i, results[i])
        return results

    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    check_picklable({"fn": fn, "initializer": initializer, "initargs": tuple(initargs), "task 0": tasks[0]},
                    needs=f"workers={workers} sends fn, initializer, initargs and the tasks to spawned processes, "
                          "so they must be picklable (a module-level function or a functools.partial of one, not a "
                          "lambda or a local function)", fix="use workers=1 to run them in this process")
    with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=mp.get_context("spawn"),
                             initializer=initializer, initargs=tuple(initargs)) as pool:
        futures = {pool.submit(fn, *args): i for i, args in enumerate(tasks)}
        try:
            for f in as_completed(futures):
                i = futures[f]
                results[i] = f.result()
                if on_result is not None:
                    on_result(i, results[i])
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return results


# --------------------------------------------------------------------------- (name, item) pairs, one shared task

_TASK: dict[str, Any] = {}


def _named_init(threads: int, fn: Callable, task: dict) -> None:
    import torch

    torch.set_num_threads(threads)
    _TASK.clear()
    _TASK.update(task, fn=fn)


def _named_call(name: str, item) -> Any:
    task = dict(_TASK)
    return task.pop("fn")(name, item, **task)


def run_pool(fn: Callable[..., Any], items: Sequence[tuple[str, Any]], task: Mapping[str, Any], *, workers: int,
             threads: int | None = None, progress: bool = True, desc: str = "members",
             on_result: Callable[[int, Any], None] | None = None) -> list:
    """``fn(name, item, **task)`` for every ``(name, item)`` of ``items``, by :func:`run_tasks`.

    ``task`` (e.g. the batches and settings every member is measured with) is sent once to each
    worker, not once per item. ``threads`` (None: leave it) is set here first, with
    ``torch.set_num_threads``, and every worker runs with this process's thread count, so each value is
    the one ``workers=1`` gives. A bar of ``desc`` counts the items (``progress``); ``on_result(index,
    result)`` as in :func:`run_tasks`. Returns the results in the order of ``items``.
    """
    import torch
    from tqdm.auto import tqdm

    if threads is not None:
        torch.set_num_threads(threads)
    bar = tqdm(total=len(items), desc=desc, unit="member", disable=not progress)

    def arrived(i: int, result) -> None:
        bar.update(1)
        if on_result is not None:
            on_result(i, result)

    try:
        return run_tasks(_named_call, [(name, item) for name, item in items], workers=workers,
                         initializer=_named_init, initargs=(torch.get_num_threads(), fn, dict(task)),
                         on_result=arrived)
    finally:
        _TASK.clear()       # the run's task held here (when the items ran in this process) is not kept
        bar.close()
