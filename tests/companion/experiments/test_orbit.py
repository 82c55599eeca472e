"""Orbit invariance (camera-ready Fig. 7) on a tiny BERT in float64.

Tolerance: Auto-PGD starts from ξ = 0 with the same seed on both models, and every step
(Riemannian gradient, horizontal projection, ball, second-order geodesic) is equivariant
under (G, H) → (G A, H A⁻ᵀ), so the transformed search is the image of the original one.
What is left is float64 rounding in the action and the Gram-matrix solves, about
1e-16 · cond(A)² ≲ 1e-11 for these 4 × 4 Gaussian A: |log ratio| < 1e-7 leaves four orders
of margin yet is far below what the action does to adaptive sharpness (> 1e-2 here).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from companion.experiments.orbit import act_on_heads, draw_head_matrices, orbit_ratios, summarise

RHO = {"adaptive": 0.5, "geodesic_invariant": 0.05, "geodesic_mixed": 0.01}


def _bert():
    import transformers

    torch.manual_seed(0)   # a larger init than BERT's 0.02 so that attention is far from uniform
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=32, max_position_embeddings=32, num_labels=3,
                                  initializer_range=0.3, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg).double().eval()


def _batch(n=8, length=7):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (n, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 3, (n,), generator=g)


def test_action_moves_weights_not_the_function():
    model = _bert()
    x, _ = _batch()
    ref = model(**x).logits
    moved = act_on_heads(copy.deepcopy(model), 100.0, draw_head_matrices(model, seed=3))
    q0 = model.bert.encoder.layer[0].attention.self.query.weight
    q1 = moved.bert.encoder.layer[0].attention.self.query.weight
    # head 0 by hand: W_Q rows of head 0 are (G Aᵀ... ) -> in maths convention G = W_Qᵀ (+bias row)
    N = draw_head_matrices(model, seed=3)[0][0][0]            # block 0, Q/K group, head 0
    assert torch.allclose(q1[:4], (100.0 * N).T @ q0[:4], rtol=1e-12, atol=1e-12)
    assert torch.allclose(moved(**x).logits, ref, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="positive"):
        act_on_heads(copy.deepcopy(model), 0.0, draw_head_matrices(model))


@pytest.mark.slow
def test_geodesic_ratio_is_one_adaptive_moves():
    model = _bert()
    frame = orbit_ratios(model, _batch(), [1e-2, 1.0, 1e2], RHO, n_iters=5, seed=0)
    assert len(frame) == 9 and set(frame["measure"]) == set(RHO)
    assert (frame["before"] > 0).all() and (frame["max_logit_change"] < 1e-10).all()
    s = summarise(frame)
    for m in ("geodesic_invariant", "geodesic_mixed"):
        assert s.loc[m, "max_abs_log_ratio"] < 1e-7, (m, s.loc[m])
    ad = frame[(frame["measure"] == "adaptive") & (frame["scale"] == 100.0)]["ratio"].item()
    assert abs(np.log(ad)) > 1e-2, ad


def test_missing_rho():
    with pytest.raises(ValueError, match="rho"):
        orbit_ratios(_bert(), _batch(), [1.0], {"adaptive": 0.5}, n_iters=1)


@pytest.mark.slow
def test_run_orbit_on_a_zoo_member(tmp_path):
    """run_orbit reads a zoo member and its first sharpness batch (a tiny zoo, 1 iteration)."""
    from companion.experiments import language_zoo as lz
    from companion.experiments.orbit import run_orbit

    spec = {"corpus": {"seed": 1, "n_train": 48, "n_dev": 15, "n_test": 18, "hard_rate": 0.1},
            "model": {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16},
            "pretrain": {"steps": 2, "batch_size": 16}, "finetune": {"n_models": 1, "epochs": 1.0, "batch_size": 16}}
    lz.train_zoo(lz.ZooSpec.from_dict(spec), tmp_path / "z", progress=False)
    batch = lz.sharpness_batches(tmp_path / "z", 16, 16, 0)[0]
    rho = {"geodesic_mixed": 0.01, "adaptive": 0.1, "geodesic_invariant": 0.01}
    frame = run_orbit(str(tmp_path / "z"), "model_000", batch, scales=[0.1, 10.0], rho=rho, n_iters=1, seed=0,
                      action_seeds=[0], dtype="float64", device="cpu")
    assert set(frame["model"]) == {"model_000"} and set(frame["dtype"]) == {"float64"}
    assert len(frame) == 6 and (frame["max_logit_change"] < 1e-10).all()
    geo = frame[frame["measure"] != "adaptive"]
    assert (np.abs(np.log(geo["ratio"])) < 1e-7).all()
    with pytest.raises(ValueError, match="dtype"):
        run_orbit(str(tmp_path / "z"), "model_000", batch, scales=[1.0], rho=rho, n_iters=1, seed=0,
                  action_seeds=[0], dtype="half", device="cpu")
