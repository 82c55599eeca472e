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
from typing import Any, Mapping, Sequence

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


def run_relative(params: Mapping[str, Any], *, n_boot: int = 2000, seed: int = 0):
    """Relative flatness of every member of ``params["zoo_dir"]`` on the sharpness batches
    (``n_points``, ``batch_size``, ``data_seed`` as the ``language`` stage), and Kendall tau
    against each gap the zoo records (no tau for fewer than 3 members). Returns ``(values, taus)``."""
    import pandas as pd

    from companion.experiments.correlation import kendall_tau

    p = dict(params)
    zoo_dir = Path(p["zoo_dir"])
    zoo = lz.load_zoo(zoo_dir)
    batches = lz.sharpness_batches(zoo_dir, int(p["n_points"]), int(p["batch_size"]), int(p.get("data_seed", 0)))
    names = [m["name"] for m in zoo["models"]][: p.get("n_models") or None]
    values = relative_flatness_values(lz.model_loaders(zoo_dir, names, p.get("device", "cpu")), batches,
                                      p.get("layer", "classifier.weight"))
    members = pd.DataFrame(zoo["models"]).set_index("name").loc[names]
    rows = []
    for g in [c for c in ("gap",) + GAP_COLUMNS if c in members and len(names) >= 3]:
        t = kendall_tau(values["value"].to_numpy(), members[g].to_numpy(dtype=float), n_boot=n_boot, seed=seed)
        rows.append(dict(measure="relative_flatness", gap=g, tau=t.tau, ci_low=t.ci_low, ci_high=t.ci_high,
                         pvalue=t.pvalue, n=t.n))
    return values.assign(**{g: members[g].to_numpy() for g in ("gap",) + GAP_COLUMNS if g in members}), \
        pd.DataFrame(rows, columns=["measure", "gap", "tau", "ci_low", "ci_high", "pvalue", "n"])
