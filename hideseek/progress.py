"""Progress for long calls: a bar over batches, over Auto-PGD iterations when there is one
batch, and over the evaluations of :func:`hideseek.suggest_rho` (issue 25, item 5).

Bars need ``tqdm`` (the ``[progress]`` extra); without it there is silently none, and
``progress=False`` switches them off.  The iteration bar of a single-batch call appears only
after :data:`DELAY` seconds, so that short calls print nothing.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["DELAY", "Progress", "evaluation_bar", "with_progress"]

#: seconds before the iteration bar of a single-batch call appears
DELAY = 2.0


def _tqdm():
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm


def with_progress(data: list, desc: str, progress: bool):
    """``data`` with a progress bar when asked and tqdm is installed, as is otherwise."""
    tqdm = _tqdm() if progress else None
    if tqdm is None:
        return data
    return tqdm(data, desc=desc, leave=False)


class Progress:
    """The feedback of one :func:`hideseek.sharpness` call: :meth:`batches` wraps the data
    in a bar over batches (several batches) and :meth:`callback` adds a bar over the
    solver's iterations (one batch, ``total`` of them) to the user's ``callback``."""

    def __init__(self, n_batches: int, total: int, desc: str, enabled: bool) -> None:
        tqdm = _tqdm() if enabled else None
        self.desc, self.tqdm = desc, tqdm
        self.per_batch = tqdm is not None and n_batches > 1
        self.bar = None
        if tqdm is not None and n_batches == 1:
            self.bar = tqdm(total=total, desc=f"{desc} (Auto-PGD iterations)", leave=False, delay=DELAY)

    def batches(self, data: list) -> Iterable:
        return self.tqdm(data, desc=self.desc, leave=False) if self.per_batch else data

    def callback(self, user: Callable | None) -> Callable | None:
        if self.bar is None:
            return user
        bar = self.bar

        def observe(step) -> Any:
            if step.iteration > 0:
                bar.update(1)
                bar.set_postfix(best_loss=f"{step.best:.6g}", refresh=False)
            return None if user is None else user(step)
        return observe

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _NoBar:
    def update(self, *a, **k) -> None:
        pass

    def set_postfix(self, *a, **k) -> None:
        pass

    def close(self) -> None:
        pass


def evaluation_bar(desc: str, enabled: bool):
    """A bar counting :func:`hideseek.suggest_rho`'s evaluations (their number is not known
    ahead: the bracket widens until it holds the target), or one that shows nothing."""
    tqdm = _tqdm() if enabled else None
    if tqdm is None:
        return _NoBar()
    return tqdm(desc=desc, unit="eval", leave=False)
