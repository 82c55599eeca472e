"""Relative flatness over the language zoo (camera-ready Fig. 6, "relative sharpness").

The camera-ready paper sets relative flatness (Petzka et al. 2021;
:func:`hideseek.relative_flatness`, docs/maths.md §11) of the classifier
on top of the pooled features beside geodesic sharpness, on the same models and the
same training batches, and finds no significant correlation with the gap.  This module
computes it for every member of a trained language zoo and its Kendall tau against the
generalisation gaps the zoo records.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from companion.experiments import language_zoo as lz

GAP_COLUMNS = ("gap_in_distribution", "gap_hans")


def relative_flatness_values(loaders: Sequence, batches: Sequence, layer: str = "classifier.weight"):
    """``model, value, per_batch, method`` for every ``(name, loader)`` on the same batches."""
    import pandas as pd

    from hideseek.relative_flatness import relative_flatness

    rows = []
    for name, load in loaders:
        res = relative_flatness(load(), batches, layer=layer)
        rows.append(dict(model=name, value=res.value, per_batch=res.per_batch, method=res.method,
                         seconds=res.seconds))
    return pd.DataFrame(rows)


def run_relative(zoo_dir: str | Path, names: Sequence[str], batches: Sequence, members, *, layer: str,
                 device: str, n_boot: int, seed: int):
    """Relative flatness of the members ``names`` of ``zoo_dir`` on ``batches`` (the ``language``
    stage's sharpness batches), and Kendall tau against each gap ``members`` (a frame indexed by
    name) records (no tau for fewer than 3 members). Returns ``(values, taus)``."""
    import pandas as pd

    from companion.experiments.correlation import kendall_tau

    values = relative_flatness_values(lz.model_loaders(zoo_dir, list(names), device), batches, layer)
    members = members.loc[list(names)]
    gaps = [c for c in ("gap",) + GAP_COLUMNS if c in members]
    rows = []
    for g in gaps if len(names) >= 3 else []:
        t = kendall_tau(values["value"].to_numpy(), members[g].to_numpy(dtype=float), n_boot=n_boot, seed=seed)
        rows.append(dict(measure="relative_flatness", gap=g, tau=t.tau, ci_low=t.ci_low, ci_high=t.ci_high,
                         pvalue=t.pvalue, n=t.n))
    return values.assign(**{g: members[g].to_numpy() for g in gaps}), \
        pd.DataFrame(rows, columns=["measure", "gap", "tau", "ci_low", "ci_high", "pvalue", "n"])
