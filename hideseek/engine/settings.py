"""The settings of a computation: the keywords every entry point takes, their checks, the
seed rule and the memory thresholds (:mod:`hideseek.engine`)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..measures import Measure
from ..solvers.apgd import SolverStep
from ..symmetries.base import SymmetryBlock

#: perturbed parameters (elements) from which ``low_memory=None`` means ``True``: 2**24, 64 MiB
#: in float32 — from there on memory, not the per-pass overhead, limits who can measure
LOW_MEMORY_FROM = 1 << 24
#: perturbed parameters (elements) from which a CPU search hands the heap memory a pass freed
#: back to the system after each pass (:func:`hideseek.utils.release_freed_memory`); below it
#: the heap holds a few MiB at most and the call would cost more than it returns
TRIM_FROM = 1 << 22


def is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_settings(measure: Measure, rho: float, n_iters: int, n_samples: int | None, seed: int) -> None:
    """The settings of the computation (the measure checks itself, :class:`Measure`)."""
    if isinstance(rho, bool) or not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a positive number, got {rho!r}")
    if not is_int(seed):
        raise ValueError(f"seed must be an integer (it seeds random starts and average-case draws), got {seed!r}")
    if not is_int(n_iters):
        raise ValueError(f"n_iters must be an integer, got {n_iters!r}")
    if n_samples is not None and not is_int(n_samples):
        raise ValueError(f"n_samples must be an integer or None, got {n_samples!r}")
    if measure.kind == "worst" and n_iters < 1:
        raise ValueError(f"n_iters must be at least 1, got {n_iters}")
    if measure.kind == "average":
        draws = n_iters if n_samples is None else n_samples
        if draws < 1:
            which = "n_iters (the number of draws when n_samples is not given)" if n_samples is None \
                else "n_samples"
            raise ValueError(f"the average case needs at least one draw: {which} is {draws}")


def check_low_memory(low_memory) -> None:
    if low_memory is not None and not isinstance(low_memory, bool):
        raise ValueError(f"low_memory must be True, False or None (automatic: True from {LOW_MEMORY_FROM} "
                         f"perturbed elements), got {low_memory!r}")


def check_restarts(restarts) -> None:
    if not is_int(restarts) or restarts < 1:
        raise ValueError(f"restarts must be an integer >= 1 (Auto-PGD starts per batch), got {restarts!r}")


#: the measure's keyword form, read by :meth:`Measure.from_keywords`
MEASURE_KEYWORDS = ("metric", "norm", "christoffel", "eps", "p", "kind")


@dataclass(frozen=True)
class Settings:
    """The settings of a computation (everything but the model, the batches and the
    measure): the keywords of :func:`hideseek.sharpness`, documented there.  Built by
    :func:`resolve`, checked by :meth:`check`."""

    rho: float = 0.1
    n_iters: int = 20
    seed: int = 0
    loss_fn: Callable | None = None
    pairs: Sequence[SymmetryBlock] | None = None
    n_samples: int | None = None
    random_start: bool = False
    on_unsupported: str = "raise"
    exclude: Sequence[str] = ()
    autocast: Any = None
    progress: bool = True
    checks: bool = True
    callback: Callable[[SolverStep], Any] | None = None
    low_memory: bool | None = None
    restarts: int = 1
    distributed: bool | str = "auto"

    def check(self, measure: Measure) -> None:
        """The settings are valid for ``measure`` (one-line errors)."""
        check_settings(measure, self.rho, self.n_iters, self.n_samples, self.seed)
        check_restarts(self.restarts)
        check_low_memory(self.low_memory)
        if not (isinstance(self.distributed, bool) or (isinstance(self.distributed, str)
                                                       and self.distributed == "auto")):
            raise ValueError(f"distributed must be 'auto', True or False, got {self.distributed!r}")


#: every keyword an entry point takes: the settings, then the measure's keyword form
KEYWORDS = tuple(f.name for f in dataclasses.fields(Settings)) + MEASURE_KEYWORDS


def resolve(entry: str, measure: Measure | str, keywords: dict[str, Any]) -> tuple[Measure, Settings]:
    """The measure and the settings that ``keywords`` give an entry point called ``entry``:
    the measure keywords (:data:`MEASURE_KEYWORDS`) replace fields of ``measure``, the
    others are :class:`Settings`; an unknown keyword is refused in one line, naming the
    closest known one."""
    unknown = [k for k in keywords if k not in KEYWORDS]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], KEYWORDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{entry}() got an unexpected keyword argument {unknown[0]!r}{hint}; it takes "
                        f"{', '.join(KEYWORDS)}")
    m = Measure.from_keywords(measure, **{k: keywords[k] for k in MEASURE_KEYWORDS if k in keywords})
    return m, Settings(**{k: v for k, v in keywords.items() if k not in MEASURE_KEYWORDS})


def seeded_generator(seed: int, i: int) -> torch.Generator:
    """The seed rule: batch ``i``'s random draws (random starts, restarts, average-case
    draws) come, in order, from one generator seeded by ``(seed, i)`` alone."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + i)
