"""Generated glyph images: the vision zoo's data distribution (training, sharpness and test sets).

Each image shows one character (its class) rendered from one of the fonts matplotlib ships
(DejaVu, STIX, Computer Modern under ``matplotlib/mpl-data/fonts/ttf``), in one of several
stroke widths, under a random affine map (rotation, anisotropic scale, shear, translation),
with random foreground and background levels, clutter (random line segments) and Gaussian
pixel noise. Nothing is downloaded and nothing is stored: every set is a pure function of
``(seed, split, n)``, so the test set can be as large as the reliability of the gap needs.

How it is made, vectorised over images (torch):

1. **Templates** (:func:`templates`): every (font, stroke width, character) drawn once with
   Pillow on a ``render`` x ``render`` canvas, the ink's bounding box centred and scaled to
   ``glyph_frac`` of the canvas; values in [0, 1]. Cached per process.
2. **Warp** (:func:`warp`): per image a 2x3 matrix ``A`` mapping output coordinates
   (normalised to [-1, 1], torch's ``affine_grid`` convention, ``align_corners=False``) to
   template coordinates, sampled bilinearly at ``supersample`` times the output size and
   average-pooled down (anti-aliasing).
3. **Clutter** (:func:`clutter`): a Poisson number of line segments per image, drawn as
   ``exp(-(d / w)^2)`` of the pixel centres' distance ``d`` to the segment.
4. **Composition**: ``background + (foreground - background) * max(glyph, clutter)`` plus
   Gaussian noise, clipped to [0, 1].

Labels are ``index mod n_classes`` (exact class balance when ``n`` is a multiple of the
class count, off by at most one otherwise). Images are produced in chunks of
:data:`CHUNK` whose random numbers come from ``SeedSequence([seed, split, chunk])`` (always whole chunks,
cut at ``n``), so a set of ``n`` images is the prefix of the same set with more images.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

#: Images per chunk (each chunk has its own random stream; see the module docstring).
CHUNK = 1000
#: Split identifiers for :func:`generate` (each split its own random streams).
SPLITS = {"train": 0, "test": 1, "pilot": 2}


@dataclass(frozen=True)
class GlyphSpec:
    """The distribution: characters, fonts, image size and the ranges of every random factor.

    ``rotation`` (degrees), ``scale``, ``aspect`` (log-uniform ratio of the x to the y scale),
    ``shear`` and ``translate`` (fraction of the half-width) are drawn uniformly in
    ``[-r, r]`` (rotation, shear, translate) or in the given interval (scale, aspect);
    ``stroke_widths`` are Pillow stroke widths at the render resolution; ``clutter`` the
    mean number of line segments per image; ``foreground``/``background`` intervals of the
    ink and paper levels; ``noise_std`` an interval for the per-image noise level.
    """

    chars: str
    fonts: tuple[str, ...]
    image_size: int
    render: int
    glyph_frac: float
    stroke_widths: tuple[int, ...]
    rotation: float
    scale: tuple[float, float]
    aspect: tuple[float, float]
    shear: float
    translate: float
    clutter: float
    clutter_width: tuple[float, float]
    foreground: tuple[float, float]
    background: tuple[float, float]
    noise_std: tuple[float, float]
    supersample: int

    @property
    def n_classes(self) -> int:
        return len(self.chars)

    def check(self) -> None:
        """One clear line for a spec that cannot work."""
        if len(set(self.chars)) != len(self.chars) or len(self.chars) < 2:
            raise ValueError(f"glyphs: chars must be >= 2 distinct characters, got {self.chars!r}")
        if self.image_size < 4 or self.render < self.image_size:
            raise ValueError(f"glyphs: need 4 <= image_size <= render, got {self.image_size}, {self.render}")
        if not self.fonts or not self.stroke_widths:
            raise ValueError("glyphs: fonts and stroke_widths must not be empty")
        for name, (lo, hi) in (("scale", self.scale), ("aspect", self.aspect), ("clutter_width", self.clutter_width),
                               ("foreground", self.foreground), ("background", self.background),
                               ("noise_std", self.noise_std)):
            if not lo <= hi:
                raise ValueError(f"glyphs: {name} must be an interval [lo, hi] with lo <= hi, got {[lo, hi]}")


def font_dir() -> Path:
    """matplotlib's bundled TrueType fonts."""
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def _render(char: str, font_file: Path, stroke: int, size: int, frac: float) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFont

    big = 4 * size
    font = ImageFont.truetype(str(font_file), size=2 * size)
    canvas = Image.new("L", (big, big), 0)
    ImageDraw.Draw(canvas).text((size, size), char, fill=255, font=font, stroke_width=stroke, stroke_fill=255)
    ink = np.asarray(canvas)
    rows, cols = np.nonzero(ink)
    if len(rows) == 0:
        raise ValueError(f"glyphs: font {font_file.name} draws nothing for {char!r}; choose another font or character")
    crop = canvas.crop((cols.min(), rows.min(), cols.max() + 1, rows.max() + 1))
    side = frac * size / max(crop.size)
    w, h = max(1, round(crop.size[0] * side)), max(1, round(crop.size[1] * side))
    out = Image.new("L", (size, size), 0)
    out.paste(crop.resize((w, h), Image.LANCZOS), ((size - w) // 2, (size - h) // 2))
    return np.asarray(out, dtype=np.float32) / 255.0


@functools.lru_cache(maxsize=8)
def _templates_cached(chars: str, fonts: tuple[str, ...], strokes: tuple[int, ...], render: int,
                      frac: float) -> torch.Tensor:
    root = font_dir()
    missing = [f for f in fonts if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"glyphs: fonts {missing} not found in {root}; choose from "
                                f"{sorted(p.name for p in root.glob('*.ttf'))}")
    out = np.stack([np.stack([_render(c, root / f, s, render, frac) for c in chars])
                    for f in fonts for s in strokes])
    return torch.from_numpy(out)


def templates(spec: GlyphSpec) -> torch.Tensor:
    """``(n_fonts * n_strokes, n_classes, render, render)`` glyph templates in [0, 1]."""
    spec.check()
    return _templates_cached(spec.chars, tuple(spec.fonts), tuple(spec.stroke_widths), spec.render,
                             spec.glyph_frac)


def affine_matrices(rotation: torch.Tensor, scale_x: torch.Tensor, scale_y: torch.Tensor, shear: torch.Tensor,
                    tx: torch.Tensor, ty: torch.Tensor) -> torch.Tensor:
    """``(n, 2, 3)`` output-to-template maps (``affine_grid`` convention) of the forward maps
    ``p -> R(rotation) S(scale) H(shear) p + t`` (angles in radians, translations normalised).

    The forward map places the glyph in the image; ``affine_grid`` needs its inverse.
    """
    c, s = torch.cos(rotation), torch.sin(rotation)
    one, zero = torch.ones_like(c), torch.zeros_like(c)
    rot = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    scl = torch.stack([torch.stack([scale_x, zero], -1), torch.stack([zero, scale_y], -1)], -2)
    shr = torch.stack([torch.stack([one, shear], -1), torch.stack([zero, one], -1)], -2)
    fwd = rot @ scl @ shr
    inv = torch.linalg.inv(fwd)
    t = torch.stack([tx, ty], -1).unsqueeze(-1)
    return torch.cat([inv, -inv @ t], -1)


def warp(glyphs: torch.Tensor, theta: torch.Tensor, size: int, supersample: int) -> torch.Tensor:
    """``glyphs`` ``(n, H, W)`` sampled through ``theta`` ``(n, 2, 3)`` at ``size`` x ``size`` (anti-aliased)."""
    n = glyphs.shape[0]
    big = size * supersample
    grid = F.affine_grid(theta, [n, 1, big, big], align_corners=False)
    out = F.grid_sample(glyphs.unsqueeze(1), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return F.avg_pool2d(out, supersample) if supersample > 1 else out


def clutter(starts: torch.Tensor, ends: torch.Tensor, widths: torch.Tensor, mask: torch.Tensor,
            size: int) -> torch.Tensor:
    """``(n, size, size)`` line segments: ``max_k mask_k exp(-(d_k / w_k)^2)``, ``d_k`` the distance of a
    pixel centre to segment ``k`` (endpoints ``(n, K, 2)`` in [-1, 1], widths in pixels)."""
    ax = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 2 - 1
    yy, xx = torch.meshgrid(ax, ax, indexing="ij")
    p = torch.stack([xx, yy], -1).reshape(1, 1, -1, 2)  # (1, 1, P, 2) pixel centres (x, y)
    a, b = starts.unsqueeze(2), ends.unsqueeze(2)
    ab = b - a
    t = ((p - a) * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-12)
    d = (a + t.clamp(0, 1).unsqueeze(-1) * ab - p).norm(dim=-1) * (size / 2)  # in pixels
    lines = torch.exp(-(d / widths.unsqueeze(-1)) ** 2) * mask.unsqueeze(-1)
    return lines.amax(1).reshape(-1, size, size) if lines.shape[1] else torch.zeros(len(starts), size, size)


def _chunk(spec: GlyphSpec, tmpl: torch.Tensor, start: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    """Images ``start .. start + n - 1`` of a set (labels ``index mod n_classes``), random numbers from ``rng``."""
    labels = np.arange(start, start + n) % spec.n_classes
    style = rng.integers(0, tmpl.shape[0], n)
    u = lambda lo, hi: torch.tensor(rng.uniform(lo, hi, n), dtype=torch.float32)  # noqa: E731
    scale = u(*spec.scale)
    aspect = torch.exp(u(math.log(spec.aspect[0]), math.log(spec.aspect[1])) / 2)
    theta = affine_matrices(u(-spec.rotation, spec.rotation) * math.pi / 180, scale * aspect, scale / aspect,
                            u(-spec.shear, spec.shear), u(-spec.translate, spec.translate),
                            u(-spec.translate, spec.translate))
    glyph = warp(tmpl[style, labels], theta, spec.image_size, spec.supersample).squeeze(1)
    k = max(1, int(math.ceil(4 * spec.clutter)) + 2)
    counts = rng.poisson(spec.clutter, n)
    mask = torch.tensor(np.arange(k)[None, :] < counts[:, None], dtype=torch.float32)
    ends = torch.tensor(rng.uniform(-1, 1, (n, 2, k, 2)), dtype=torch.float32)
    widths = torch.tensor(rng.uniform(*spec.clutter_width, (n, k)), dtype=torch.float32)
    ink = torch.maximum(glyph, clutter(ends[:, 0], ends[:, 1], widths, mask, spec.image_size))
    fg, bg = u(*spec.foreground), u(*spec.background)
    noise = u(*spec.noise_std)[:, None, None] * torch.tensor(
        rng.standard_normal((n, spec.image_size, spec.image_size)), dtype=torch.float32)
    return (bg[:, None, None] + (fg - bg)[:, None, None] * ink + noise).clamp(0, 1)


def generate(spec: GlyphSpec, n: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images ``(n, 1, size, size)`` float32 in [0, 1] and labels ``(n,)`` int64 of ``split``.

    Deterministic in ``(spec, seed, split, n)``; a set is the prefix of a larger one.
    """
    if split not in SPLITS:
        raise ValueError(f"glyphs: split must be one of {sorted(SPLITS)}, got {split!r}")
    if n < 1:
        raise ValueError(f"glyphs: n must be >= 1, got {n}")
    tmpl = templates(spec)
    parts = []
    for c, start in enumerate(range(0, n, CHUNK)):
        rng = np.random.default_rng(np.random.SeedSequence([seed, SPLITS[split], c]))
        parts.append(_chunk(spec, tmpl, start, CHUNK, rng)[: n - start])  # whole chunks: prefixes agree
    labels = torch.as_tensor(np.arange(n) % spec.n_classes, dtype=torch.int64)
    return torch.cat(parts).unsqueeze(1), labels
