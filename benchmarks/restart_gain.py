"""Gain of Auto-PGD restarts on the vision zoo (issue 16, item 5; exploratory).

For the first ``--members`` members of the trained vision zoo, each Table 1 measure at its
pre-registered radius (``params.yaml`` ``vision.rho``) on the first ``--batches`` sharpness
batches, with the stage's iterations: ``hs.sharpness(..., restarts=K)`` (the start at zero plus
K − 1 random starts). Reports, per measure, the relative gain of the best start over the start
at zero (``restart_values``) and whether the members' ranking changes::

    python -m benchmarks.restart_gain --members 8 --restarts 8 --json reports/pilots/vision_restarts.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import scipy.stats
import torch

import hideseek as hs
from companion.experiments import vision_zoo as vz
from companion.params import stage_params


def measure(members: int, restarts: int, batches: int) -> dict:
    _, p = stage_params("vision", "cpu")
    meta, loaders = vz.load_zoo(p["zoo_dir"])
    batch_list = vz.sharpness_batches(vz.zoo_data(meta), batches * p["batch_size"], p["batch_size"])
    out = {}
    for key, name in p["measures"].items():
        zero, best = [], []
        for _, load in loaders[:members]:
            res = hs.sharpness(load(), batch_list, hs.Measure.parse(name), rho=p["rho"][key], n_iters=p["n_iters"],
                               seed=p["seed"], restarts=restarts, progress=False)
            zero.append(float(np.mean([v[0] for v in res.restart_values])))
            best.append(res.value)
        zero, best = np.array(zero), np.array(best)
        gain = (best - zero) / np.abs(zero)
        out[key] = dict(rho=p["rho"][key], zero=zero.tolist(), best=best.tolist(),
                        median_gain=float(np.median(gain)), max_gain=float(gain.max()),
                        n_improved=int((gain > 0).sum()),
                        kendall_zero_vs_best=float(scipy.stats.kendalltau(zero, best).statistic))
    return dict(members=members, restarts=restarts, batches=batches, batch_size=p["batch_size"],
                n_iters=p["n_iters"], measures=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--restarts", type=int, default=8)
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    res = measure(args.members, args.restarts, args.batches)
    for key, r in res["measures"].items():
        print(f"{key:20s} rho {r['rho']:<5g} median gain {r['median_gain']:+.2%}  max {r['max_gain']:+.2%}  "
              f"improved {r['n_improved']}/{res['members']}  tau(zero, best) {r['kendall_zero_vs_best']:+.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
