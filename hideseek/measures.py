"""One typed description of a sharpness measure.

A :class:`Measure` says everything that defines a measure — which geometry the ball lives
in, which metric, which norm, which step, the ε relaxation, ℓ2 or ℓ∞, worst or average
case — and names itself.  Everything else (the radius ρ, the iterations, the seed) is a
setting of the computation, not of the measure.  See docs/maths.md §7 (sharpness measures
and the ablations of the paper's Appendix G).

=================  ===================================  =========================================
field              values                               meaning
=================  ===================================  =========================================
``geometry``       ``"adaptive"`` | ``"geodesic"``      elementwise ball on every parameter,
                   | ``"euclidean"``                    the GL(h) quotient geometry on the pairs,
                                                        or SAM's plain ball ``‖ξ‖_p`` (no scale)
``metric``         ``"invariant"`` | ``"mixed"`` | …    pair metric (paper Eq. 9 / Eq. 10; any
                                                        name registered in ``METRICS``);
                                                        geodesic only (``None`` for adaptive)
``p``              ``"l2"`` | ``"linf"``                ℓ∞ for the adaptive/euclidean geometries
``ball``           ``"riemannian"`` | ``"adaptive"``    the pair metric with horizontal ξ, or
                                                        adaptive sharpness's ``‖ξ ⊘ |θ|‖₂`` ball
``step``           ``"second_order"`` | ``"straight"``  ``θ + ξ + ½Γ(ξ, ξ)``, ``θ + ξ`` or the
                   | ``"exact"``                        geodesic itself (closed form for GL(1),
                                                        else integrated, docs/maths.md §5.6)
``eps``            ≥ 0                                  ε relaxation ``S ↦ S + εI`` (geodesic)
``kind``           ``"worst"`` | ``"average"``          Auto-PGD maximum or mean over the sphere
=================  ===================================  =========================================

Names are the ones the results have always carried (``m_apgd_l2``, ``avg_linf``,
``geodesic_mixed``, ``geodesic_mixed_no_christoffel``, ``avg_geodesic_invariant`` …), and
``euclidean_l2`` / ``euclidean_linf`` / ``avg_euclidean_l2`` for the plain (SAM) ball;
ε is not part of the name (reports carry it beside), it is part of the :attr:`Measure.label`.

>>> Measure.parse("geodesic_mixed_no_christoffel")
Measure(geometry='geodesic', metric='mixed', p='l2', ball='riemannian', step='straight', eps=0.0, kind='worst')
>>> Measure(geometry="adaptive", p="linf").name
'm_apgd_linf'
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch import Tensor

from .geometry.free import FREE_PARTS, FreePart, free_part_names, get_free_part  # noqa: F401 (FREE_PARTS re-exported)
from .geometry.metrics import METRICS, PairMetric, metric_names  # noqa: F401 (METRICS re-exported)
from .geometry.space import ProductGeometry

#: the geometry with GL(h) pairs; every other geometry is a registered free part
#: (:data:`hideseek.geometry.free.FREE_PARTS`: one elementwise ball on every parameter, straight step)
GEODESIC = "geodesic"
#: the free part of the geodesic geometry (the parameters outside pairs)
GEODESIC_FREE_PART = "adaptive"


def geometry_names() -> tuple[str, ...]:
    """The values of :attr:`Measure.geometry`: ``"geodesic"`` and the registered free parts."""
    return (GEODESIC,) + free_part_names()


#: the geometries at import (:func:`geometry_names` also lists free parts registered later)
GEOMETRIES = geometry_names()
#: the pair metrics are the registry :data:`hideseek.geometry.metrics.METRICS` (name → class)
PS = ("l2", "linf")
BALLS = ("riemannian", "adaptive")
STEPS = ("second_order", "straight", "exact")
KINDS = ("worst", "average")

#: ``christoffel=`` of the keyword form ↔ ``step``
_STEP_OF_CHRISTOFFEL = {True: "second_order", False: "straight", "exact": "exact"}
_CHRISTOFFEL_OF_STEP = {"second_order": True, "straight": False, "exact": "exact"}
#: name suffix and label tag of each (ball, step) of the geodesic geometry
_ABLATIONS = {("riemannian", "second_order"): ("", ""),
              ("riemannian", "straight"): ("_no_christoffel", "no-christoffel"),
              ("riemannian", "exact"): ("_exact", "exact"),
              ("adaptive", "second_order"): ("_christoffel_only", "christoffel-only"),
              ("adaptive", "straight"): ("_adaptive_norm_straight", "adaptive-norm-straight")}


def _choice(field: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"Measure: {field} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class Measure:
    """What defines a sharpness measure (see the module docstring for the fields).

    ``metric``, ``ball`` and ``step`` left as ``None`` take the geometry's defaults:
    geodesic — ``"invariant"``, ``"riemannian"``, ``"second_order"``; adaptive — no metric,
    ``"adaptive"``, ``"straight"``; euclidean — no metric, ``"euclidean"``, ``"straight"``.  ``Measure()`` is the paper's geodesic sharpness with
    the invariant metric.

    Examples
    --------
    >>> import hideseek as hs
    >>> m = hs.Measure.parse("geodesic_mixed_no_christoffel")
    >>> m.geometry, m.metric, m.step
    ('geodesic', 'mixed', 'straight')
    >>> hs.Measure.parse(m.name) == m                                # a measure round-trips through its name
    True
    >>> hs.Measure(geometry="adaptive", p="linf").name
    'm_apgd_linf'
    """

    geometry: str = "geodesic"
    metric: str | None = None
    p: str = "l2"
    ball: str | None = None
    step: str | None = None
    eps: float = 0.0
    kind: str = "worst"

    def __post_init__(self) -> None:
        _choice("geometry", self.geometry, geometry_names())
        _choice("kind", self.kind, KINDS)
        _choice("p", self.p, PS)
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) \
                or not math.isfinite(self.eps) or self.eps < 0:
            raise ValueError(f"Measure: eps must be a finite number >= 0, got {self.eps!r}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("eps", float(self.eps))
        if not self.has_pairs:
            g = self.geometry
            if self.metric is not None:
                raise ValueError(f"Measure: the {g} geometry has no metric (got metric={self.metric!r}); "
                                 "drop metric= or use geometry='geodesic'")
            if self.ball not in (None, g) or self.step not in (None, "straight"):
                raise ValueError(f"Measure: the {g} geometry has the {g} ball and the straight step "
                                 f"only (got ball={self.ball!r}, step={self.step!r}); use geometry='geodesic' "
                                 "for the Riemannian ball or a geodesic step")
            if self.eps != 0.0:
                raise ValueError(f"Measure: eps relaxes the pair metric's Gram matrices, the {g} geometry "
                                 f"has none (got eps={self.eps!r}); drop eps= or use geometry='geodesic'")
            set_("ball", g)
            set_("step", "straight")
            return
        if isinstance(self.metric, type) and issubclass(self.metric, PairMetric):
            set_("metric", self.metric.name)   # a metric class stands for its registered name
        set_("metric", "invariant" if self.metric is None else self.metric)
        set_("ball", "riemannian" if self.ball is None else self.ball)
        set_("step", "second_order" if self.step is None else self.step)
        _choice("metric", self.metric, metric_names())
        _choice("ball", self.ball, BALLS)
        _choice("step", self.step, STEPS)
        if self.p != "l2":
            raise ValueError("Measure: geodesic sharpness uses the ℓ2 (metric) ball; p='linf' is for "
                             "geometry='adaptive'")
        if self.step == "exact" and self.ball != "riemannian":
            raise ValueError("Measure: step='exact' (the geodesic itself) needs ball='riemannian' "
                             f"(got ball={self.ball!r}); use step='second_order' for the Christoffel-only ablation")

    # ------------------------------------------------------------------ parts
    @property
    def has_pairs(self) -> bool:
        """Whether the geometry has GL(h) pairs (the geodesic one); else it is one free part."""
        return self.geometry == GEODESIC

    @property
    def free_part(self) -> type[FreePart]:
        """The geometry of the parameters outside pairs: the registered free part
        (:data:`~hideseek.geometry.free.FREE_PARTS`) the geometry names, the adaptive one for
        the geodesic geometry."""
        return get_free_part(GEODESIC_FREE_PART if self.has_pairs else self.geometry)

    # ------------------------------------------------------------------ names
    @property
    def name(self) -> str:
        """Identifier used in results and file layouts (ε not included)."""
        if not self.has_pairs:
            return self.free_part.measure_name(self.p, self.kind)
        name = f"geodesic_{self.metric}" + _ABLATIONS[self.ball, self.step][0]
        return name if self.kind == "worst" else "avg_" + name

    @property
    def label(self) -> str:
        """Human-readable label, distinct for distinct measures (ε included)."""
        eps = [] if self.eps == 0.0 else [f"ε={self.eps:g}"]
        if not self.has_pairs:
            base = f"{self.geometry} {'ℓ2' if self.p == 'l2' else 'ℓ∞'}" + (f" [{eps[0]}]" if eps else "")
        else:
            tags = [t for t in (_ABLATIONS[self.ball, self.step][1],) if t] + eps
            base = f"geodesic_{self.metric}" + (f"[{', '.join(tags)}]" if tags else "")
        return base if self.kind == "worst" else "average " + base

    # ------------------------------------------------------- what the engine reads
    @property
    def norm(self) -> str:
        """The ball as the geometry's ``norm=`` switch (``"riemannian"`` / ``"adaptive"``;
        ``"euclidean"`` for the euclidean geometry, which has no pairs)."""
        return self.ball

    @property
    def christoffel(self) -> bool | str:
        """The step as the geometry's ``christoffel=`` switch (``True``/``False``/``"exact"``)."""
        return _CHRISTOFFEL_OF_STEP[self.step]

    def geometry_at(self, params: Mapping[str, Tensor], blocks: Sequence = ()) -> ProductGeometry:
        """The perturbation space of this measure at the point ``params`` (``name -> tensor``,
        the parameters to perturb): a :class:`~hideseek.geometry.space.ProductGeometry` with
        the pairs of ``blocks`` (geodesic geometry only) and the measure's ball elsewhere —
        adaptive ``‖ξ ⊘ |θ|‖_p`` or, for ``geometry="euclidean"``, plain ``‖ξ‖_p``."""
        if not self.has_pairs and blocks:
            raise ValueError(f"Measure: the {self.geometry} geometry has no pairs (got {len(blocks)} blocks)")
        return ProductGeometry(params, blocks, metric=self.metric or "invariant", eps=self.eps,
                               norm=self.ball if self.has_pairs else "riemannian",
                               christoffel=self.christoffel, p=self.p, free_part=self.free_part)

    # ------------------------------------------------------------ conversions
    def replace(self, **changes: Any) -> "Measure":
        """A copy with ``changes``.  Changing ``geometry`` resets ``metric``, ``ball`` and
        ``step`` to the new geometry's defaults unless they are given too."""
        if "geometry" in changes and changes["geometry"] != self.geometry:
            for k in ("metric", "ball", "step"):
                changes.setdefault(k, None)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (YAML/JSON); :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    def to_keywords(self) -> dict[str, Any]:
        """The keyword form of :func:`hideseek.sharpness` for this measure (what
        :meth:`from_keywords` reads back): ``measure`` (the geometry), ``p``, ``kind`` and,
        for the geodesic geometry, ``metric``, ``norm``, ``christoffel``, ``eps``."""
        kw: dict[str, Any] = dict(measure=self.geometry, p=self.p, kind=self.kind)
        if self.has_pairs:
            kw.update(metric=self.metric, norm=self.norm, christoffel=self.christoffel, eps=self.eps)
        return kw

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Measure":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"Measure.from_dict: unknown keys {sorted(unknown)}; known: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**d)

    @classmethod
    def parse(cls, name: "str | Measure") -> "Measure":
        """The measure called ``name`` (inverse of :attr:`name`, ε = 0), or one of the
        aliases ``"adaptive"`` (adaptive ℓ2, worst case), ``"euclidean"`` (SAM's ℓ2 ball, worst
        case) and ``"geodesic"`` (``Measure()``)."""
        if isinstance(name, Measure):
            return name
        if not isinstance(name, str):
            raise TypeError(f"a measure is a Measure or its name (str), got {type(name).__name__}")
        table = _by_name()
        if name not in table:
            raise ValueError(f"unknown measure {name!r}; known: {sorted(table)}")
        return table[name]

    @classmethod
    def from_keywords(cls, measure: "str | Measure" = "geodesic", *, metric: str | None = None,
                      p: str | None = None, kind: str | None = None, norm: str | None = None,
                      christoffel: bool | str | None = None, eps: float | None = None) -> "Measure":
        """The keyword form of :func:`hideseek.sharpness`: the measure ``measure`` names
        (a name, an alias or a :class:`Measure`), with every keyword that is not ``None``
        replacing its field (``norm`` → ``ball``, ``christoffel`` → ``step``)."""
        m = cls.parse(measure)
        changes: dict[str, Any] = {k: v for k, v in dict(metric=metric, p=p, kind=kind, ball=norm, eps=eps).items()
                                   if v is not None}
        if christoffel is not None:
            if christoffel not in _STEP_OF_CHRISTOFFEL:
                raise ValueError(f"christoffel must be True, False or 'exact', got {christoffel!r}")
            changes["step"] = _STEP_OF_CHRISTOFFEL[christoffel]
        return m.replace(**changes) if changes else m

    @classmethod
    def all(cls) -> list["Measure"]:
        """Every valid measure with ε = 0."""
        out = []
        for kind in KINDS:
            out += [cls(geometry=g, p=p, kind=kind) for g in free_part_names() for p in PS]
            out += [cls(metric=metric, ball=ball, step=step, kind=kind)
                    for metric in metric_names() for ball, step in _ABLATIONS]
        return out


_TABLE: dict[str, Measure] = {}
_TABLE_PARTS: list[tuple] = [()]


def _by_name() -> dict[str, Measure]:
    parts = (metric_names(), free_part_names())
    if not _TABLE or _TABLE_PARTS[0] != parts:   # rebuilt when a metric or a free part is registered
        _TABLE.clear()
        _TABLE_PARTS[0] = parts
        _TABLE.update({m.name: m for m in Measure.all()})
        _TABLE[GEODESIC] = Measure()
        _TABLE.update({g: Measure(geometry=g) for g in free_part_names()})   # aliases: worst case, ℓ2
    return _TABLE
