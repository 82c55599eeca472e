"""Pilot of the MiniLM row (pre-registration), run on members outside the main zoo, without any gap–sharpness
correlation being computed.

On ``n_members`` pilot members (the main recipe, fine-tuning seeds ``base_seed…``, never in the main zoo) it
measures:

1. **the radius scan**: the three measures of :data:`companion.experiments.zoo.STANDARD` at every radius of a
   grid fixed in advance, ``n_iters`` Auto-PGD iterations, on ``2 · n_half`` batches of ``batch_size`` training
   pairs (halves A and B, disjoint pairs);
2. **diagnostics** on the first ``diag_members`` members, first batch, every (measure, radius): where the
   maximiser lives (``norm_share`` of the query/key and value/output pairs against the other parameters), the
   second-order correction ratio ``‖½γ̈(0)‖/‖ξ‖`` of the geodesic step, and what is perturbed (the pre-trained
   attention of the top layers: :func:`companion.experiments.minilm_zoo.attention_drift` for every member);
3. per (measure, radius) the **variance components** of the per-batch values (log) over all pilot members
   (:func:`companion.pilots.language.variance_components`): member variance ``s_m`` and residual
   ``s_e``; the mean over ``k`` batches per half then has the retest τ ``(2/π)·arcsin(s_m/(s_m + s_e/k))``, and
   the primary value (the mean of both halves, ``2k`` batches) the Pearson reliability ``s_m/(s_m + s_e/(2k))``;
4. the **gap reliability** (split halves of the dev pairs, Spearman–Brown) — the gap's own noise, not its
   relation to sharpness;
5. the **cost**: training seconds per member (this zoo's timings) and sharpness seconds per batch and iteration,
   per measure (the scan), on this machine.

Rules, fixed in ``params.yaml`` (section ``minilm_pilot``) before any pilot number was read:

* **ρ per measure**: among the radii whose median correction ratio (diagnostics) is at most
  ``max_correction_ratio`` (geodesic measures; adaptive has none), the one with the highest variance-component
  retest at ``n_half`` batches per half; ties: the smaller radius; when no radius passes the ratio rule, the
  smallest radius.
* **protocol and members**: for every candidate ``k`` of ``batches_per_half`` the cost of one main member
  (training + the three measures at ``2k`` batches × ``n_iters``), the largest even zoo (≤ ``max_members``) that
  ``budget_seconds`` of wall time with ``workers`` processes allows, and the Monte Carlo power of the paired Δτ
  (:func:`paired_power`, the design of ``reports/preregistration/delta_tau.md``) at the paper's Δ; chosen: the
  ``k`` whose smaller power (of the two geodesic measures) is highest (ties: fewer batches), and then the smallest
  member count of ``members_grid`` whose power reaches ``target_power`` for both, else the budget's cap.

Command line::

    python -m companion.pilots.minilm --out reports/pilots/minilm.json

trains the pilot zoo first when ``zoo_dir`` holds none (``python -m companion.experiments.minilm_zoo train``
with the main recipe of ``minilm_train`` and ``n_members`` / ``base_seed`` of this section), and writes the
report ``minilm.json`` and ``minilm.md`` beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from companion import paper
from companion import analysis
from companion.experiments import minilm_zoo as mz
from companion.experiments.language_report import split_half
from companion.pilots.common import write_json_report

GEODESIC, BASELINE = paper.GEODESIC, paper.BASELINE


@dataclass(frozen=True)
class MiniLMPilotSettings:
    zoo_dir: str
    base_seed: int
    n_members: int
    batch_size: int
    n_half: int
    data_seed: int
    seed: int
    workers: int
    threads: int
    n_iters: int
    rho_grid: dict[str, list[float]]
    max_correction_ratio: float
    diag_members: int
    target: float
    max_train_error: float
    gap_splits: int
    batches_per_half: list[int]
    members_grid: list[int]
    max_members: int
    budget_seconds: float
    target_power: float
    power_n_sim: int
    power_n_boot: int
    confidence: float


# --------------------------------------------------------------------------- measuring


def scan(s: MiniLMPilotSettings, progress: bool = True) -> pd.DataFrame:
    """Per-batch values of every measure at every radius (cached in ``zoo_dir/pilot/scan.pkl``)."""
    from companion.experiments.zoo import STANDARD, measure_zoo

    cache = Path(s.zoo_dir) / "pilot" / f"scan_i{s.n_iters}_b{s.n_half}x{s.batch_size}_d{s.data_seed}_s{s.seed}.pkl"
    if cache.is_file():
        return pd.read_pickle(cache)
    src = mz.MiniLMZoo(s.zoo_dir)
    batches = src.sharpness_batches(2 * s.n_half * s.batch_size, s.batch_size, s.data_seed)
    frame = measure_zoo(src.loaders(), batches, {k: {"measure": m} for k, m in STANDARD.items()}, s.rho_grid,
                        seed=s.seed, n_iters=s.n_iters, progress=progress, workers=s.workers)
    cache.parent.mkdir(exist_ok=True)
    frame.to_pickle(cache)
    return frame


def diagnostics(s: MiniLMPilotSettings) -> pd.DataFrame:
    """norm_share, correction ratio and the perturbed parameters at every (measure, radius) for the first
    ``diag_members`` members on the first batch (cached in ``zoo_dir/pilot/diagnostics.pkl``)."""
    import hideseek as hs
    from companion.experiments.zoo import STANDARD

    cache = Path(s.zoo_dir) / "pilot" / f"diagnostics_i{s.n_iters}_m{s.diag_members}.pkl"
    if cache.is_file():
        return pd.read_pickle(cache)
    src = mz.MiniLMZoo(s.zoo_dir)
    batch = src.sharpness_batches(s.batch_size, s.batch_size, s.data_seed)
    rows = []
    for name, load in src.loaders()[: s.diag_members]:
        top = load()
        blocks = hs.find_symmetries(top)
        for measure, m in STANDARD.items():
            for rho in s.rho_grid[measure]:
                res = hs.sharpness(top, batch, m, rho=rho, n_iters=s.n_iters, seed=s.seed, progress=False)
                rows.append(dict(model=name, measure=measure, rho=rho, value=res.value,
                                 share_qk=res.norm_share.get("qk", 0.0), share_vo=res.norm_share.get("vo", 0.0),
                                 share_free=res.norm_share.get("free", 0.0),
                                 correction_ratio=max(res.correction_ratio) if res.correction_ratio else math.nan,
                                 n_perturbed=res.n_perturbed_params,
                                 attention_perturbed=sum(".attention." in p for p in res.perturbed_params),
                                 n_symmetry_blocks=len(blocks), blocks="; ".join(map(str, blocks))))
    frame = pd.DataFrame(rows)
    cache.parent.mkdir(exist_ok=True)
    frame.to_pickle(cache)
    return frame


def drift(s: MiniLMPilotSettings) -> pd.DataFrame:
    """:func:`companion.experiments.minilm_zoo.attention_drift` of every pilot member."""
    src = mz.MiniLMZoo(s.zoo_dir)
    base = src._base()
    rows = []
    for name, load in src.loaders():
        rows += [dict(model=name, **r) for r in mz.attention_drift(load(), base, src.spec.n_frozen)]
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- analysis


def _values(g: pd.DataFrame) -> np.ndarray:
    return np.array([list(v) for v in g["per_batch"]], dtype=float)


def retest_table(frame: pd.DataFrame, s: MiniLMPilotSettings, fitted: Sequence[str]) -> pd.DataFrame:
    """Per (measure, radius), over the members ``fitted``: :func:`companion.analysis.batch_retest` of the mean over a
    whole half (the direct retest between half A and half B, its mean over every split of the batches into two
    halves, and the variance components)."""
    rows = []
    for (measure, rho), g in frame.groupby(["measure", "rho"], sort=False):
        g = g[g["model"].isin(list(fitted))]
        v = _values(g)
        rows.append(dict(measure=measure, rho=float(rho), **analysis.batch_retest(v, v.shape[1] // 2, target=s.target),
                         seconds_per_batch_iter=float(g["seconds"].sum() / (v.size * s.n_iters))))
    return pd.DataFrame(rows)


def choose_rho(table: pd.DataFrame, diag: pd.DataFrame, s: MiniLMPilotSettings) -> dict[str, float]:
    """The pre-registered rule (module docstring): the ratio rule, then the highest variance-component retest."""
    ratio = diag.groupby(["measure", "rho"])["correction_ratio"].median()
    out = {}
    for measure, g in table.groupby("measure", sort=False):
        ok = g[[not (ratio.get((measure, r), math.nan) > s.max_correction_ratio) for r in g["rho"]]]
        if ok.empty:
            out[measure] = float(g["rho"].min())
            continue
        out[measure] = float(ok.sort_values(["retest_vc", "rho"], ascending=[False, True])["rho"].iloc[0])
    return out


def paired_power(n: int, *, tau_a: float, tau_g: float, sign: float, rel_a: float, rel_g: float, rel_y: float,
                 corr_ag: float, n_sim: int, n_boot: int, confidence: float, seed: int) -> float:
    """Monte Carlo power of the paired Δτ = sign·(τ_g − τ_a) over ``n`` members at Pearson reliabilities ``rel_a``,
    ``rel_g`` (the measures' values) and ``rel_y`` (the gap) and the latent (error-free) Pearson correlation
    ``corr_ag`` of the two measures: :func:`companion.analysis.delta_power` (the design of
    ``reports/preregistration/delta_tau.md``), whose reliabilities are on the Kendall-τ scale of a retest and whose
    correlation of the measures is the observed τ — both converted here. 0 when a measure has no signal."""
    if n < 4:
        raise ValueError(f"n must be >= 4 members, got {n}")
    for name, r in (("rel_a", rel_a), ("rel_g", rel_g), ("rel_y", rel_y)):
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {r}")
    if rel_a <= 0 or rel_g <= 0:
        return 0.0
    to_tau = lambda r: 2 / math.pi * math.asin(min(r, 1.0))  # noqa: E731 (Pearson -> Kendall, Greiner)
    observed = float(np.clip(corr_ag, -0.99, 0.99)) * math.sqrt(rel_a * rel_g)
    return analysis.delta_power(n, tau_g, tau_a, retest_x=to_tau(rel_g), retest_base=to_tau(rel_a), rel_y=rel_y,
                                tau_between=to_tau(observed) if observed >= 0 else -to_tau(-observed),
                                sign=int(sign), n_sim=n_sim, n_boot=n_boot, seed=seed, confidence=confidence)


def paper_delta() -> dict[str, float]:
    """The paper's signed Δτ per geodesic measure (MNLI row), from :mod:`companion.paper`."""
    tau = paper.table1_tau("language")
    sign = math.copysign(1.0, tau["geodesic_mixed"])
    return {g: sign * (tau[g] - tau[BASELINE]) for g in GEODESIC}


def member_cost(train_seconds: float, sec_per_batch_iter: Mapping[str, float], k: int, n_iters: int) -> float:
    """Wall seconds of one main member in one worker: training + the three measures at ``2k`` batches."""
    return train_seconds + sum(2 * k * n_iters * v for v in sec_per_batch_iter.values())


def plan(s: MiniLMPilotSettings, comps: Mapping[str, tuple[float, float]], corr: Mapping[str, float], rel_y: float,
         train_seconds: float, sec_per_batch_iter: Mapping[str, float]) -> dict:
    """The protocol and member count of the main zoo (the pre-registered rule of the module docstring)."""
    tau = paper.table1_tau("language")
    sign = math.copysign(1.0, tau["geodesic_mixed"])
    options = []
    for k in s.batches_per_half:
        cost = member_cost(train_seconds, sec_per_batch_iter, k, s.n_iters)
        cap = int(min(s.max_members, s.budget_seconds * s.workers // cost))
        cap -= cap % 2
        rel = {m: analysis.component_reliability(*comps[m], 2 * k) for m in comps}
        if cap < 4:
            options.append(dict(k=k, cost_seconds=cost, cap=cap, reliability=rel, power={g: 0.0 for g in GEODESIC}))
            continue
        pw = {g: paired_power(cap, tau_a=tau[BASELINE], tau_g=tau[g], sign=sign, rel_a=rel[BASELINE], rel_g=rel[g],
                              rel_y=rel_y, corr_ag=corr[g], n_sim=s.power_n_sim, n_boot=s.power_n_boot,
                              confidence=s.confidence, seed=s.seed) for g in GEODESIC}
        options.append(dict(k=k, cost_seconds=cost, cap=cap, reliability=rel, power=pw))
    best = max(options, key=lambda o: (min(o["power"].values()), -o["k"]))
    k, cap = best["k"], best["cap"]
    grid = []
    for n in sorted(set([m for m in s.members_grid if m <= cap] + [cap])):
        if n < 4:
            continue
        pw = best["power"] if n == cap else {
            g: paired_power(n, tau_a=tau[BASELINE], tau_g=tau[g], sign=sign, rel_a=best["reliability"][BASELINE],
                            rel_g=best["reliability"][g], rel_y=rel_y, corr_ag=corr[g], n_sim=s.power_n_sim,
                            n_boot=s.power_n_boot, confidence=s.confidence, seed=s.seed) for g in GEODESIC}
        grid.append(dict(n=n, **{f"power_{g}": p for g, p in pw.items()}))
    enough = [r["n"] for r in grid if min(r[f"power_{g}"] for g in GEODESIC) >= s.target_power]
    n_models = min(enough) if enough else cap
    at = next(r for r in grid if r["n"] == n_models)
    return {"batches_per_half": k, "n_points": 2 * k * s.batch_size, "batch_size": s.batch_size, "n_iters": s.n_iters,
            "n_models": n_models, "cap_binds": not enough, "options": options, "power_grid": grid,
            "power_at_n_models": {g: at[f"power_{g}"] for g in GEODESIC},
            "predicted_retest_half": {m: analysis.component_retest(*comps[m], k) for m in comps},
            "predicted_reliability": best["reliability"],
            "estimated_wall_seconds": n_models * best["cost_seconds"] / s.workers}


def corr_between(frame: pd.DataFrame, rho: Mapping[str, float], comps: Mapping[str, tuple[float, float]],
                 n_batches: int) -> dict[str, float]:
    """Latent corr(A, G) per geodesic measure: Kendall τ between the pilot values (all members, chosen ρ) → Pearson
    (sin(πτ/2)), disattenuated by the two values' reliabilities at the scan's ``n_batches``."""
    val = {m: frame[(frame["measure"] == m) & (frame["rho"] == r)].set_index("model")["value"] for m, r in rho.items()}
    out = {}
    for g in GEODESIC:
        t = stats.kendalltau(val[BASELINE].to_numpy(), val[g].loc[val[BASELINE].index].to_numpy()).statistic
        r = math.sin(math.pi * t / 2)
        rr = math.sqrt(max(analysis.component_reliability(*comps[BASELINE], n_batches)
                           * analysis.component_reliability(*comps[g], n_batches), 1e-12))
        out[g] = float(np.clip(r / rr, -0.99, 0.99))
    return out


def run(s: MiniLMPilotSettings, progress: bool = True) -> dict:
    zoo = mz.load_zoo(s.zoo_dir)
    seeds = [m["seed"] for m in zoo["models"]]
    if min(seeds) != s.base_seed or len(seeds) != s.n_members:
        raise ValueError(f"{s.zoo_dir} holds seeds {min(seeds)}…{max(seeds)} ({len(seeds)} members); the pilot section "
                         f"says {s.n_members} from {s.base_seed}: delete the folder to retrain it")
    t0 = time.perf_counter()
    frame = scan(s, progress)
    t_scan = time.perf_counter() - t0
    diag = diagnostics(s)
    fitted = [m["name"] for m in zoo["models"] if m["train_error"] <= s.max_train_error]
    # the retest over ALL pilot members (decided after the pilot members' train errors, before any sharpness was
    # read: the one-epoch recipe leaves every member near the same train error, so none sits apart)
    table = retest_table(frame, s, [m["name"] for m in zoo["models"]])
    rho = choose_rho(table, diag, s)
    at = table[[rho[m] == r for m, r in zip(table["measure"], table["rho"])]].set_index("measure")
    comps = {m: (float(r.s_member), float(r.s_resid)) for m, r in at.iterrows()}
    spb = {m: float(r.seconds_per_batch_iter) for m, r in at.iterrows()}
    errors = mz.MiniLMZoo(s.zoo_dir).eval_errors([m["name"] for m in zoo["models"]])
    train_err = np.array([m["train_error"] for m in zoo["models"]])
    rel_y = split_half(errors, train_err, s)
    timings = json.loads(Path(mz.lz.timings_file(s.zoo_dir)).read_text())
    train_seconds = float(np.median([v["seconds"] for v in timings["members"].values()]))
    corr = corr_between(frame, rho, comps, 2 * s.n_half)
    pre = plan(s, comps, corr, max(0.0, min(1.0, rel_y)), train_seconds, spb)
    dr = drift(s)
    return {"settings": asdict(s), "n_members": len(seeds), "seeds": seeds, "n_fitted": len(fitted),
            "members": [{k: m[k] for k in ("name", "seed", "train_error", "dev_error", "test_error")}
                        for m in zoo["models"]],
            "setting": zoo["setting"], "finetune": zoo["spec"]["finetune"], "n_parameters": zoo["n_parameters"], "base": zoo["base"],
            "n_dev": zoo["corpus"]["dev"], "retest": table.to_dict("records"), "rho": rho,
            "diagnostics": diag.to_dict("records"), "drift": dr.to_dict("records"),
            "gap_reliability": rel_y, "corr_latent": corr, "paper_delta": paper_delta(),
            "paper_tau": paper.table1_tau("language"), "preregistration": pre,
            "machine": {"train_seconds_per_member": train_seconds, "seconds_per_batch_iter": spb,
                        "scan_seconds": t_scan, "load_average": list(os.getloadavg())}}


# --------------------------------------------------------------------------- the report


def markdown(r: dict) -> str:
    """The pilot report, generated from ``r``."""
    s, pre = r["settings"], r["preregistration"]
    t = pd.DataFrame(r["retest"])
    d = pd.DataFrame(r["diagnostics"])
    dr = pd.DataFrame(r["drift"])
    ratio = d.groupby(["measure", "rho"])["correction_ratio"].median()
    share = d.groupby(["measure", "rho"])[["share_qk", "share_vo", "share_free"]].mean()
    b = r["base"]
    lines = [
        "# MiniLM pilot: radii, protocol, fit rule and member count of the MiniLM row (generated)", "",
        f"Row: {r['setting']}. Base: {b['model']} ({b['n_parameters']:,} parameters, {b['n_layers']} layers; weights "
        f"SHA-256 {b['weights_sha256'][:16]}…). Frozen and cached: the embeddings and layers 0–{b['n_frozen'] - 1}; "
        f"fine-tuned and perturbed: layers {b['n_frozen']}–{b['n_layers'] - 1}, the pooler and the classifier "
        f"({r['n_parameters']:,} parameters).", "",
        f"{r['n_members']} pilot members (seeds {min(r['seeds'])}–{max(r['seeds'])}, not in the main zoo; "
        f"{r['n_fitted']} with train error ≤ {s['max_train_error']:g}); dev set of {r['n_dev']} pairs. "
        "No correlation between sharpness and the gap was computed.", "",
        "| member | seed | train error | dev error | test (HANS-like) error |", "|---|---|---|---|---|"]
    lines += [f"| {m['name']} | {m['seed']} | {m['train_error']:.3f} | {m['dev_error']:.3f} | {m['test_error']:.3f} |"
              for m in r["members"]]
    lines += ["", "## Does the measure see the pre-trained attention?", "",
              f"`hideseek.find_symmetries` on a member finds {int(d['n_symmetry_blocks'].iloc[0])} attention blocks: "
              f"{d['blocks'].iloc[0]}. Every sharpness call "
              f"perturbs {int(d['n_perturbed'].iloc[0])} parameter tensors, {int(d['attention_perturbed'].iloc[0])} of "
              "them attention weights and biases.", "",
              "Share of the maximiser's squared norm (measure's own norm; mean over the diagnosed members, first batch):", "",
              "| measure | rho | query/key | value/output | other | median correction ratio |", "|---|---|---|---|---|---|"]
    for (m, rho), row in share.iterrows():
        cr = ratio.get((m, rho), math.nan)
        lines.append(f"| {m} | {rho:g} | {row.share_qk:.3f} | {row.share_vo:.3f} | {row.share_free:.3f} | "
                     + ("–" if math.isnan(cr) else f"{cr:.2f}") + " |")
    g = dr.groupby(["layer", "matrix"])
    lines += ["", "The perturbed attention weights are MiniLM's, moved by fine-tuning (relative change ‖W − W₀‖/‖W₀‖ "
              "and cosine to the pre-trained W₀, range over the pilot members; a re-initialised matrix would have "
              "cosine ≈ 0):", "", "| layer | matrix | relative change | cosine to pre-trained |", "|---|---|---|---|"]
    for (layer, mat), gg in g:
        lines.append(f"| {layer} | {mat} | {gg['relative_change'].min():.4f}–{gg['relative_change'].max():.4f} | "
                     f"{gg['cosine'].min():.4f}–{gg['cosine'].max():.4f} |")
    lines += ["", f"## Radius scan ({2 * s['n_half']} batches of {s['batch_size']}, halves of {s['n_half']}, "
              f"{s['n_iters']} iterations; all pilot members)", "",
              "| measure | rho | retest (one split) | retest (all splits) | retest (variance comp.) | s_resid / s_member |",
              "|---|---|---|---|---|---|"]
    for x in t.itertuples():
        mark = " (chosen)" if r["rho"][x.measure] == x.rho else ""
        lines.append(f"| {x.measure} | {x.rho:g}{mark} | {x.retest:.2f} | {x.retest_splits:.2f} | {x.retest_vc:.2f} | "
                     f"{x.noise_ratio:.2f} |")
    lines += ["", f"Rule: the highest variance-component retest among radii with median correction ratio ≤ "
              f"{s['max_correction_ratio']:g}. Chosen: " + ", ".join(f"{k} {v:g}" for k, v in r["rho"].items()) + ".",
              "", f"Gap reliability (dev − train, split halves of the dev pairs, Spearman–Brown): "
              f"{r['gap_reliability']:.2f}. Latent correlation adaptive–geodesic (from the pilot values, "
              "disattenuated): " + ", ".join(f"{k} {v:.2f}" for k, v in r["corr_latent"].items()) + ".", "",
              "## Protocol and member count (paired Δτ, primary)", "",
              "Paper's Δτ (MNLI row, sign of the paper's τ, from companion.paper): "
              + ", ".join(f"{k} {v:+.2f}" for k, v in r["paper_delta"].items()) + ".", "",
              f"Cost on this machine (load average at the end {r['machine']['load_average'][0]:.1f} on 2 cores): "
              f"training {r['machine']['train_seconds_per_member']:.0f} s per member; sharpness per batch and "
              "iteration " + ", ".join(f"{k} {v:.2f} s" for k, v in r["machine"]["seconds_per_batch_iter"].items())
              + f". Budget for the main zoo: {s['budget_seconds'] / 60:.0f} min of wall time with {s['workers']} "
              "processes.", "",
              "| batches per half | seconds per member | members the budget allows | reliability (adaptive / inv. / mixed) "
              "| power Δ invariant | power Δ mixed |", "|---|---|---|---|---|---|"]
    for o in pre["options"]:
        rel = o["reliability"]
        lines.append(f"| {o['k']} | {o['cost_seconds']:.0f} | {o['cap']} | {rel['adaptive']:.2f} / "
                     f"{rel['geodesic_invariant']:.2f} / {rel['geodesic_mixed']:.2f} | "
                     f"{o['power']['geodesic_invariant']:.2f} | {o['power']['geodesic_mixed']:.2f} |")
    lines += ["", "Power against members at the chosen protocol:", "",
              "| members | power Δ invariant | power Δ mixed |", "|---|---|---|"]
    lines += [f"| {x['n']} | {x['power_geodesic_invariant']:.2f} | {x['power_geodesic_mixed']:.2f} |"
              for x in pre["power_grid"]]
    return "\n".join(lines + _preregistration_lines(r)) + "\n"


def _preregistration_lines(r: dict) -> list[str]:
    """The pilot report's last section: the rules applied to the pilot's numbers."""
    s, pre = r["settings"], r["preregistration"]
    lines = ["", "## Pre-registration (the rules applied)", "",
             "rho: " + ", ".join(f"{k} {v:g}" for k, v in r["rho"].items()) + ".",
              f"Protocol: {pre['batches_per_half']} batches of {pre['batch_size']} per half ({pre['n_points']} training "
              f"pairs in all) × {pre['n_iters']} iterations; members: {pre['n_models']}; fit rule: every member trained "
              f"{r['finetune']['epochs']:g} epochs, all members in the primary τ (train error > "
              f"{s['max_train_error']:g} only in an exploratory line).",
              "Predicted retest of the halves: " + ", ".join(f"{k} {v:.2f}" for k, v in pre["predicted_retest_half"].items())
              + f" (target {s['target']:g}); power of the paired Δτ at the paper's Δ with {pre['n_models']} members: "
              + ", ".join(f"{k} {v:.2f}" for k, v in pre["power_at_n_models"].items()) + "."]
    flat = sorted(m for m, r in pre["predicted_reliability"].items() if r <= 0)
    if flat:
        lines.append(f"At the chosen radii the pilot finds no member variance for {', '.join(flat)} (variance components: "
                     f"s_member ≤ 0 on {2 * s['n_half']} batches of {r['n_members']} members), so its predicted reliability is 0 at every candidate "
                     "protocol and so is every power above; the pre-registered tie-break (fewer batches) then decides. "
                     "A zoo this size and this noisy cannot test the paper's Δ; its τ and Δτ are reported as measured.")
    if pre["cap_binds"]:
        lines.append(f"**The CPU budget binds**: no member count the budget allows reaches {s['target_power']:g} power; "
                     f"the zoo has the budget's {pre['n_models']} members and the power above.")
    lines.append(f"Estimated wall time of the main zoo on this machine: {pre['estimated_wall_seconds'] / 60:.0f} min.")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from companion.params import settings

    ap = argparse.ArgumentParser(prog="python -m companion.pilots.minilm", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/pilots/minilm.json")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite the .md from an existing .json report")
    args = ap.parse_args(argv)
    if args.markdown_only:
        out = Path(args.out)
        out.with_suffix(".md").write_text(markdown(json.loads(out.read_text())))
        return 0
    s = settings(MiniLMPilotSettings, "minilm_pilot", args.profile, args.set)
    if not (Path(s.zoo_dir) / "zoo.json").is_file():
        cmd = [sys.executable, "-m", "companion.experiments.minilm_zoo", "train", "--out", s.zoo_dir,
               "--set", f"finetune.n_models={s.n_members}", "--set", f"finetune.base_seed={s.base_seed}"]
        cmd += ["--no-progress"] if args.no_progress else []
        cmd += ["--profile", args.profile] if args.profile else []
        subprocess.run(cmd, check=True)
    import torch

    torch.set_num_threads(s.threads)
    write_json_report(Path(args.out), run(s, progress=not args.no_progress), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
