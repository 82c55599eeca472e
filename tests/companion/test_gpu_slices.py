"""companion.gpu_slices: a slice end to end with tiny settings on the CPU, in a process where dvc, papermill,
nbformat, seaborn and open_clip cannot be imported (the GPU machine has none of them); the per-member tables
it writes are read by the stage paired's loaders, and their τ checked against scipy."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from tests import ROOT

BLOCKED = ("dvc", "papermill", "nbformat", "seaborn", "open_clip", "sklearn")

TINY = {
    "language.n_models": 3, "language.train.corpus.n_train": 64, "language.train.corpus.n_dev": 40,
    "language.train.corpus.n_test": 30, "language.train.finetune.epochs": 1, "language.train.finetune.batch_size": 16,
    "language.train.device": "cpu", "language.measure.n_points": 32, "language.measure.batch_size": 16,
    "language.measure.n_iters": 1, "language.measure.n_boot": 50, "language.measure.gap_splits": 10,
    "vision.n_models": 3, "vision.train.device": "cpu", "vision.train.data.n_train": 64, "vision.train.data.n_test": 40,
    "vision.train.data.spec.image_size": 8, "vision.train.data.spec.render": 16,
    "vision.train.model": {"width": 8, "layers": 1, "heads": 2, "patch_size": 4, "mlp_ratio": 2.0, "embed_dim": 8,
                           "logit_scale": 10.0},
    "vision.train.pretrain.epochs": 1, "vision.train.pretrain.batch_size": 32, "vision.train.ranges.epochs": [1, 2],
    "vision.train.ranges.batch_size": [16], "vision.measure.n_images": 16, "vision.measure.batch_size": 8,
    "vision.measure.n_iters": 1, "vision.measure.n_boot": 50, "vision.measure.n_splits": 10,
}

SCRIPT = textwrap.dedent('''
    import json, sys
    BLOCKED = {blocked!r}
    for name in BLOCKED:      # None in sys.modules: `import` fails, importlib.util.find_spec says "not installed"
        sys.modules[name] = None
    from pathlib import Path
    from companion import gpu_slices as gs
    from companion.experiments import nli_corpus as nc
    from companion.params import stage_params

    out = Path({out!r})
    spec = nc.CorpusSpec(**{{**stage_params("language_train", "gpu")[1]["corpus"], "n_train": 64, "n_dev": 40,
                             "n_test": 30}})
    nc.save_corpus(nc.make_corpus(spec), out / "base_corpus")
    tok = nc.make_tokenizer(out / "base_corpus" / "vocab.txt")
    tok.save_pretrained(out / "base")
    from transformers import BertConfig, BertModel
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(out / "base")
    s = gs.load_settings(overrides={{**json.loads({tiny!r}), "language.train.base": str(out / "base")}})
    budget = float(sys.argv[1])
    ran = gs.run(s, out / "slices", budget_s=budget, log=lambda m: None)
    print(json.dumps([[r, u] for r, u, _ in ran]))
    print("loaded:", sorted(m for m, v in sys.modules.items() if m.split(".")[0] in BLOCKED and v is not None))
''')


def _run(out: Path, budget: float) -> list:
    code = SCRIPT.format(blocked=BLOCKED, out=str(out), tiny=json.dumps(TINY))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code, str(budget)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == "loaded: []"
    return json.loads(lines[-2])


@pytest.mark.slow
def test_a_slice_runs_end_to_end_without_the_packages_the_gpu_machine_lacks(tmp_path):
    # budget 0: exactly one unit per command, the next unfinished one
    assert _run(tmp_path, 0) == [["language", "member_000"]]
    # then everything that is left, from the next unfinished unit on
    ran = _run(tmp_path, 1e9)
    assert ran[0] == ["language", "member_001"] and ran[-1] == ["vision", "analysis"]
    assert ["vision", "pretrain"] in ran and len(ran) == 2 + 1 + 1 + 3 + 1
    state = json.loads((tmp_path / "slices" / "state.json").read_text())
    assert set(state["done"]["vision"]) == {"pretrain", "member_000", "member_001", "member_002", "analysis"}
    assert not list((tmp_path / "slices").rglob("model_*.pt"))          # member weights are not kept

    from companion.experiments import paired

    for row in ("language", "vision"):
        d = tmp_path / "slices" / row
        members = pd.read_csv(d / "members.csv", index_col="name", float_precision="round_trip")
        sharp = pd.read_csv(d / "sharpness.csv", float_precision="round_trip")
        assert len(members) == 3 and set(sharp.measure) == {"adaptive", "geodesic_invariant", "geodesic_mixed"}
        metrics = json.loads((d / "metrics.json").read_text())
        assert metrics["profile"] == "gpu" and "not pre-registered" in metrics["radii"]
        assert (d / f"{row}_gpu_scatter.png").is_file()
        for r in metrics["primary"]:
            at = sharp[sharp.measure == r["measure"]].set_index("model").loc[members.index]
            pb = np.array([json.loads(v) for v in at["per_batch"]])
            value = pb[:, :2].mean(1) if row == "vision" else pb.mean(1)    # vision: set 1 of 2 batches
            ref = stats.kendalltau(value, members["gap"]).statistic
            assert r["tau"] == pytest.approx(ref, nan_ok=True)
        # the stage paired reads these tables as it reads the cpu stages' (same layouts)
        s = paired.load_settings({"rows": {row: {"row": row, "layout": row, "data": str(d), "comparison": "primary"}}, "baseline": "adaptive",
                                  "geodesic": ["geodesic_invariant", "geodesic_mixed"], "n_boot": 20, "seed": 0,
                                  "confidence": 0.95, "power": {"n_sim": 2, "n_boot": 10, "seed": 0},
                                  "mde": None, "retest_splits": {"n_splits": 3, "seed": 0},
                                  "exploratory": {"row": row, "factors": [], "control": "train_error"}})
        rd = paired.load_row(row, s.rows[row], s)
        assert len(rd.values["adaptive"]) == 3


def test_plan_lists_every_unit_in_order_and_settings_refuse_unknown_keys(tmp_path):
    from companion import gpu_slices as gs

    s = gs.load_settings(overrides={"language.n_models": 2, "vision.n_models": 1})
    assert gs.plan(s, tmp_path) == [("language", "member_000", False), ("language", "member_001", False),
                                    ("language", "analysis", False), ("vision", "pretrain", False),
                                    ("vision", "member_000", False), ("vision", "analysis", False)]
    assert s["language"].train["base"] == "minilm" and s["language"].measure["n_iters"] == 20   # the paper's protocol
    assert s["vision"].train["model"]["patch_size"] == 4                                       # 16 patch tokens
    with pytest.raises(KeyError, match="no key 'nope'"):
        gs.load_settings(overrides={"vision.train.nope": 1})
