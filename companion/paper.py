"""The paper's numbers, in one place (ICML 2025, "Hide & Seek"; the camera-ready version).

Everything the companion compares against — Table 1's Kendall τ, the ablation τ of Figure 8, the
protocols of Section 6.2 — is read from here, so a number quoted in a figure, a findings sentence
or ``reports/table1.md`` cannot drift from the others.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

#: The three measures of Table 1, in its column order (``hideseek.Measure(...).name``).
TABLE1_MEASURES: tuple[str, ...] = ("adaptive", "geodesic_invariant", "geodesic_mixed")
#: The paper's comparison: each geodesic measure against the baseline, adaptive sharpness.
BASELINE: str = TABLE1_MEASURES[0]
GEODESIC: tuple[str, ...] = TABLE1_MEASURES[1:]


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


#: Table 1: Kendall τ between each measure and generalisation, per row (in the paper's order).
#: diagonal: 50 diagonal networks, τ against the test loss; vision: 72 CLIP ViT-B/32 fine-tunes on
#: ImageNet (Figure 4); language: 35 BERT fine-tunes of McCoy et al. (2020) on MNLI (Figure 5).
TABLE1_TAU: Mapping[str, Mapping[str, float]] = _frozen({
    "diagonal": _frozen({"adaptive": -0.68, "geodesic_invariant": -0.83, "geodesic_mixed": -0.86}),
    "vision": _frozen({"adaptive": -0.41, "geodesic_invariant": -0.71, "geodesic_mixed": -0.70}),
    "language": _frozen({"adaptive": 0.06, "geodesic_invariant": 0.28, "geodesic_mixed": 0.38}),
})

#: Table 1's rows: the paper's setting and the number of models it correlates over.
TABLE1_SETTING: Mapping[str, str] = _frozen({
    "diagonal": "Diagonal networks (50 nets)",
    "vision": "ImageNet, CLIP ViT-B/32 fine-tunes (72 models)",
    "language": "MNLI, BERT fine-tunes (35 models)",
})
TABLE1_N_MODELS: Mapping[str, int] = _frozen({"diagonal": 50, "vision": 72, "language": 35})

#: Figure 8 (mixed metric): full geodesic sharpness and without the second-order (Christoffel)
#: step; Figure 7 (invariant metric) gives only the full value (the text: "a small drop only").
LANGUAGE_ABLATION_TAU: Mapping[str, float] = _frozen({
    "geodesic_mixed": 0.38, "geodesic_mixed_no_christoffel": 0.24, "geodesic_invariant": 0.28})

#: The paper's protocol for the ImageNet zoo (Section 6.2.1).
VISION_PROTOCOL: Mapping[str, Any] = _frozen(dict(
    n_models=72, model="CLIP ViT-B/32 (~88M parameters), 12 layers, width 768, 12 heads",
    data="ImageNet-1k", n_images=2048, batch_size=256, n_iters=20, rho_grid="not given"))

#: The paper's protocol for the MNLI zoo (Section 6.2.2).
LANGUAGE_PROTOCOL: Mapping[str, Any] = _frozen(dict(
    n_models=35, model="bert-base-uncased (110M parameters), McCoy et al. (2020) fine-tunes",
    data="MNLI", n_points=1024, batch_size=128, n_iters=20))


def table1_tau(row: str) -> dict[str, float]:
    """Table 1's τ per measure for ``row`` (``diagonal``, ``vision`` or ``language``), as a new dict."""
    if row not in TABLE1_TAU:
        raise KeyError(f"Table 1 has no row {row!r}; rows: {', '.join(TABLE1_TAU)}")
    return dict(TABLE1_TAU[row])
