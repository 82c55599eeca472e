"""companion.pool: the one worker pool (order kept, set-up in every worker, callback, in-process at 1, errors).

The functions the workers run are module-level here (a spawned worker imports this module by name);
this module imports neither torch nor the companion's experiments, so a worker starts in well under a
second.
"""
from __future__ import annotations

import os
import re
import time

import pytest

from companion import pool
from tests import ROOT

_STATE: dict = {}


def _init(tag: str) -> None:
    _STATE["tag"] = tag


def _work(i: int, wait_for: str | None = None, write: str | None = None) -> tuple[int, str | None, int]:
    """``(i, the initializer's tag in this process, pid)``, after ``wait_for`` exists (10 s at most) and
    ``write`` is written."""
    deadline = time.monotonic() + 10
    while wait_for is not None and not os.path.exists(wait_for) and time.monotonic() < deadline:
        time.sleep(0.01)
    if write is not None:
        open(write, "w").close()
    return i, _STATE.get("tag"), os.getpid()


def _fail(i: int) -> int:
    if i == 1:
        raise ValueError(f"task {i} failed")
    return i


def _named(name: str, item: int, *, scale: int) -> tuple[str, int]:
    return name, item * scale


def test_two_workers_keep_the_task_order_run_the_initializer_and_report_every_result(tmp_path):
    # task 0 waits until task 1 has run, so it finishes after it (in another process: the first worker is
    # held by task 0), yet the results come back in task order
    flag = str(tmp_path / "task1-ran")
    tasks = [(0, flag, None), (1, None, flag), (2,), (3,)]
    seen = []
    out = pool.run_tasks(_work, tasks, workers=2, initializer=_init, initargs=("set",),
                         on_result=lambda i, r: seen.append((i, r)))
    assert [i for i, _, _ in out] == [0, 1, 2, 3]
    assert {tag for _, tag, _ in out} == {"set"}                       # the worker-global set by the initializer
    pids = {pid for _, _, pid in out}
    assert len(pids) == 2 and os.getpid() not in pids                  # two workers, none of it here
    assert sorted(seen) == list(enumerate(out))                        # every result, each once, with its index
    order = [i for i, _ in seen]
    assert order.index(1) < order.index(0)                             # ... as it arrived


def test_one_worker_runs_here_after_the_initializer():
    _STATE.clear()
    seen = []
    out = pool.run_tasks(_work, [(0,), (1,)], workers=1, initializer=_init, initargs=("here",),
                         on_result=lambda i, r: seen.append(i))
    assert out == [(0, "here", os.getpid()), (1, "here", os.getpid())]
    assert seen == [0, 1]
    # one task runs here whatever workers says
    assert pool.run_tasks(_work, [(5,)], workers=4)[0][2] == os.getpid()
    assert pool.run_tasks(_work, [], workers=4) == []


def test_an_exception_in_a_worker_propagates():
    with pytest.raises(ValueError, match="task 1 failed"):
        pool.run_tasks(_fail, [(0,), (1,), (2,)], workers=2)


@pytest.mark.parametrize("workers, error, message", [
    (0, ValueError, r"workers must be >= 1, got 0; use 1"),
    (-2, ValueError, r"workers must be >= 1"),
    (1.5, TypeError, r"workers must be a whole number"),
    (True, TypeError, r"workers must be a whole number"),
])
def test_bad_workers_are_refused(workers, error, message):
    with pytest.raises(error, match=message):
        pool.run_tasks(_fail, [(0,)], workers=workers)


def test_bad_tasks_and_arguments_are_refused_before_anything_runs():
    with pytest.raises(TypeError, match=r"task 1 is 3: each task is a tuple .* \(arg,\)"):
        pool.run_tasks(_fail, [(0,), 3], workers=1)
    with pytest.raises(ValueError, match="initargs given without an initializer"):
        pool.run_tasks(_fail, [(0,)], workers=1, initargs=(1,))
    with pytest.raises(TypeError, match=r"must be picklable.*fn is not .*use workers=1"):
        pool.run_tasks(lambda i: i, [(0,), (1,)], workers=2)
    with pytest.raises(TypeError, match=r"must be picklable.*task 0 is not"):
        pool.run_tasks(_fail, [(lambda: 0,), (1,)], workers=2)


def test_check_picklable_names_the_object_and_the_fix():
    pool.check_picklable({"a": 1, "b": [2]}, needs="n", fix="f")
    with pytest.raises(TypeError, match=r"^needs it; model 'm' is not \(.*\); do this$"):
        pool.check_picklable({"fine": 1, "model 'm'": lambda: 0}, needs="needs it", fix="do this")


def test_run_pool_calls_fn_with_the_shared_task_in_order_and_keeps_nothing():
    seen = []
    out = pool.run_pool(_named, [("a", 1), ("b", 2)], {"scale": 10}, workers=1, progress=False,
                        on_result=lambda i, r: seen.append(i))
    assert out == [("a", 10), ("b", 20)] and seen == [0, 1]
    assert not pool._TASK                                                 # the shared task is not held afterwards


# the modules that still make their own pool, each to be moved onto companion.pool (then dropped from here): none
KNOWN_OWN_POOLS: set[str] = set()


def test_no_companion_module_but_the_pool_makes_a_process_pool():
    mentions = {p.relative_to(ROOT).as_posix() for p in (ROOT / "companion").rglob("*.py")
                if re.search(r"\bProcessPoolExecutor\b", p.read_text())}
    assert mentions - KNOWN_OWN_POOLS == {"companion/pool.py"}, (
        "make the pool with companion.pool.run_tasks (or run_pool), not a ProcessPoolExecutor of its own: "
        f"{sorted(mentions - KNOWN_OWN_POOLS - {'companion/pool.py'})}")
    stale = sorted(KNOWN_OWN_POOLS - mentions)
    assert not stale, f"{stale} no longer make their own pool: drop them from KNOWN_OWN_POOLS"
