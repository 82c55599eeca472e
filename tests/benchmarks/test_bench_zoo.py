"""Smoke test of benchmarks/bench_zoo.py (no timing is asserted): the zoo's values agree with the
loop's, the pass times and the ceiling are measured, the zoo architectures build from the
companion's settings."""
import math

import pytest
import torch

from benchmarks import bench_zoo
from benchmarks.models import MODELS, build, make_batches


def test_bench_zoo_measures_passes_and_ceiling():
    row = bench_zoo.bench("tiny-bert", "adaptive", members=2, batch_size=None, n_iters=2, repeats=1, restarts=2)
    assert row["batch"] == MODELS["tiny-bert"].defaults["cpu"]["batch_size"]
    assert row["max_rel_diff"] < 1e-3
    assert row["pass_separate_s"] > 0 and row["pass_vmap_s"] > 0
    assert math.isclose(row["ceiling"], row["loop_s"] / (row["pass_separate_s"] + 2 * row["pass_vmap_s"]))
    text = bench_zoo.table([row])
    assert text.count("| tiny-bert | adaptive |") == 1 and "×" in text


@pytest.mark.slow
def test_zoo_architectures_follow_the_companion_settings():
    from companion.experiments import vision_zoo

    vit = build("glyph-vit")
    s = vision_zoo.load_settings("cpu")
    assert vit.visual.conv1.kernel_size == (s.model.patch_size,) * 2
    assert len(vit.visual.transformer.resblocks) == s.model.layers
    from companion import params
    from companion.experiments import language_zoo

    spec = language_zoo.ZooSpec.from_params(params.stage_params("language_train", "cpu")[1])
    bert = build("nli-bert")
    assert (bert.config.num_hidden_layers, bert.config.hidden_size, bert.config.intermediate_size) == \
        (spec.model.num_hidden_layers, spec.model.hidden_size, spec.model.intermediate_size)
    for name in ("glyph-vit", "nli-bert"):
        (x, y), = make_batches(MODELS[name], 3, 1, seq_len=40)
        model = build(name)
        out = model(**x) if isinstance(x, dict) else model(x)
        logits = out if torch.is_tensor(out) else out.logits
        assert logits.shape == (3, MODELS[name].n_classes)
