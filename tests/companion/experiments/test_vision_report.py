"""vision_report's published sharpness table: ``value`` is the first set's mean, the value every τ uses."""
import json

import numpy as np
import pandas as pd
import pytest

from companion.experiments import vision_report as vr


def _frame(n_models=4, n_batches=6, seed=0, with_sets=True):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_models):
        for m in ("adaptive", "geodesic_mixed"):
            pb = rng.uniform(0, 1, n_batches if with_sets else n_batches // 2).tolist()
            rows.append(dict(model=f"model_{i:03d}", measure=m, rho=0.1, value=float(np.mean(pb)), per_batch=pb,
                             base_loss=[0.5] * len(pb)))
    return pd.DataFrame(rows)


def test_value_is_the_first_set_mean_and_value_set2_the_second():
    prim = _frame()
    explore = _frame(seed=1, with_sets=False).assign(rho=0.2)
    out = vr.sharpness_table(prim, explore, 3)
    p = out[out["set"] == "primary"]
    for r, src in zip(p.itertuples(), prim.itertuples()):
        assert r.value == np.mean(src.per_batch[:3]) and r.value_set2 == np.mean(src.per_batch[3:])
    e = out[out["set"] == "exploratory"]
    assert np.array_equal(e["value"].to_numpy(), explore["value"].to_numpy()) and e["value_set2"].isna().all()


def test_republish_rewrites_an_old_table_from_its_own_per_batch_values(tmp_path):
    prim = _frame()
    old = pd.concat([prim.assign(set="primary"), _frame(seed=2, with_sets=False).assign(set="exploratory")])
    old = old.assign(per_batch=old["per_batch"].map(json.dumps), base_loss=old["base_loss"].map(json.dumps))
    path = tmp_path / "sharpness.csv"
    old.to_csv(path, index=False)
    vr.republish_sharpness(path, 3)
    new = pd.read_csv(path, float_precision="round_trip")
    assert list(new.columns) == [*old.columns, "value_set2"]
    first = new[new["set"] == "primary"]
    assert first["value"].tolist() == [float(np.mean(json.loads(v)[:3])) for v in first["per_batch"]]
    again = vr.republish_sharpness(path, 3)     # idempotent
    assert again["value"].tolist() == new["value"].tolist()
    pd.DataFrame({"model": ["a"], "value": [1.0]}).to_csv(path, index=False)
    with pytest.raises(ValueError, match="no per_batch/set columns"):
        vr.republish_sharpness(path, 3)
