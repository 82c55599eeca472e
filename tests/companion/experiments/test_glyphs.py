"""companion.experiments.glyphs: determinism, shapes and ranges, class balance, the transforms by hand."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from companion.experiments import glyphs as g

SPEC = g.GlyphSpec(
    chars="0123456789", fonts=("DejaVuSans.ttf", "DejaVuSerif-Italic.ttf", "cmtt10.ttf"), image_size=12, render=24,
    glyph_frac=0.8, stroke_widths=(0, 2), rotation=15.0, scale=(0.6, 1.0), aspect=(0.8, 1.25), shear=0.2,
    translate=0.2, clutter=1.0, clutter_width=(0.4, 0.9), foreground=(0.6, 1.0), background=(0.0, 0.3),
    noise_std=(0.02, 0.1), supersample=2)


def test_deterministic_and_a_set_is_the_prefix_of_a_larger_one():
    x1, y1 = g.generate(SPEC, 1100, 3, "train")
    x2, y2 = g.generate(SPEC, 1100, 3, "train")
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x3, _ = g.generate(SPEC, 1030, 3, "train")  # crosses the chunk boundary at 1000
    assert torch.equal(x3, x1[:1030])
    other_seed, _ = g.generate(SPEC, 50, 4, "train")
    other_split, _ = g.generate(SPEC, 50, 3, "test")
    assert not torch.allclose(other_seed, x1[:50]) and not torch.allclose(other_split, x1[:50])


def test_shapes_ranges_and_class_balance():
    x, y = g.generate(SPEC, 1000, 0, "test")
    assert x.shape == (1000, 1, 12, 12) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.min() >= 0 and x.max() <= 1 and 0.05 < x.mean() < 0.6
    assert np.bincount(y.numpy(), minlength=10).tolist() == [100] * 10
    _, y = g.generate(SPEC, 1003, 0, "test")
    counts = np.bincount(y.numpy(), minlength=10)
    assert counts.max() - counts.min() == 1 and counts.sum() == 1003
    # the images carry their class: the mean image of each class differs from the others'
    means = torch.stack([x[torch.arange(1000) % 10 == c].mean(0) for c in range(10)])
    assert (torch.cdist(means.flatten(1), means.flatten(1)) + torch.eye(10)).min() > 0.1


def test_templates_are_centred_inked_and_bad_fonts_refused():
    t = g.templates(SPEC)
    assert t.shape == (3 * 2, 10, 24, 24) and t.min() >= 0 and t.max() <= 1
    ink = t.sum((-1, -2))
    assert (ink > 5).all()
    assert (t[1::2].sum((-1, -2)) > t[0::2].sum((-1, -2))).all()  # a wider stroke puts down more ink
    for tile in t.flatten(0, 1):  # the ink's bounding box is centred and fills glyph_frac of the larger side
        rows, cols = np.nonzero(tile.numpy() > 0.02)
        centre = ((rows.min() + rows.max()) / 2, (cols.min() + cols.max()) / 2)
        assert abs(centre[0] - 11.5) <= 1.5 and abs(centre[1] - 11.5) <= 1.5
        assert 0.8 * 24 - 2 <= max(rows.max() - rows.min(), cols.max() - cols.min()) + 1 <= 0.8 * 24 + 2
    with pytest.raises(FileNotFoundError, match="not found"):
        g.templates(dataclasses.replace(SPEC, fonts=("NoSuchFont.ttf",)))
    with pytest.raises(ValueError, match="distinct"):
        g.templates(dataclasses.replace(SPEC, chars="00"))
    with pytest.raises(ValueError, match="split"):
        g.generate(SPEC, 3, 0, "validation")


def test_warp_by_hand_identity_quarter_turn_and_integer_shift():
    img = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    zero, one = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    ident = g.affine_matrices(zero, one, one, zero, zero, zero)
    assert torch.equal(ident, torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64).expand(2, 2, 3))
    assert torch.allclose(g.warp(img, ident, 8, 1).squeeze(1), img, atol=1e-12)
    # a quarter turn maps pixel centres onto pixel centres: the result is numpy's rot90 of the image
    quarter = g.affine_matrices(torch.full((2,), math.pi / 2, dtype=torch.float64), one, one, zero, zero, zero)
    turned = g.warp(img, quarter, 8, 1).squeeze(1).numpy()
    ref = [np.rot90(img[i].numpy(), k=1) for i in range(2)]  # counter-clockwise with rows pointing down
    ok = [np.allclose(turned[i], ref[i], atol=1e-6) or np.allclose(turned[i], np.rot90(img[i].numpy(), k=-1), atol=1e-6)
          for i in range(2)]
    assert all(ok)
    # translating by 2/8 of the half-width... exactly 1 pixel = 2/8 in normalised units: a shifted copy, blank-filled
    shift = g.affine_matrices(zero, one, one, zero, torch.full((2,), 2 / 8, dtype=torch.float64), zero)
    moved = g.warp(img, shift, 8, 1).squeeze(1)
    assert torch.allclose(moved[:, :, 1:], img[:, :, :-1], atol=1e-12) and torch.all(moved[:, :, 0] == 0)


def test_affine_matrices_invert_the_forward_map_by_hand():
    rot, sx, sy, sh, tx, ty = 0.3, 0.8, 1.1, 0.2, 0.1, -0.15
    theta = g.affine_matrices(*[torch.tensor([v], dtype=torch.float64) for v in (rot, sx, sy, sh, tx, ty)])[0]
    c, s = math.cos(rot), math.sin(rot)
    fwd = np.array([[c, -s], [s, c]]) @ np.diag([sx, sy]) @ np.array([[1, sh], [0, 1]])
    p = np.array([0.3, -0.4])
    q = fwd @ p + np.array([tx, ty])  # where template point p lands in the image
    back = theta[:, :2].numpy() @ q + theta[:, 2].numpy()
    assert np.allclose(back, p, atol=1e-12)


def test_clutter_segment_against_a_pixel_loop():
    size = 6
    a, b = torch.tensor([[[-0.5, 0.0]]]), torch.tensor([[[0.5, 0.2]]])
    w = torch.tensor([[0.7]])
    got = g.clutter(a, b, w, torch.ones(1, 1), size)[0]
    for i in range(size):
        for j in range(size):
            p = np.array([(j + 0.5) / size * 2 - 1, (i + 0.5) / size * 2 - 1])  # (x, y) of pixel (row i, col j)
            pa, pb = a[0, 0].numpy(), b[0, 0].numpy()
            t = np.clip(np.dot(p - pa, pb - pa) / np.dot(pb - pa, pb - pa), 0, 1)
            d = np.linalg.norm(pa + t * (pb - pa) - p) * size / 2
            assert got[i, j].item() == pytest.approx(math.exp(-(d / 0.7) ** 2), abs=1e-6)
    assert torch.equal(g.clutter(a, b, w, torch.zeros(1, 1), size), torch.zeros(1, size, size))
