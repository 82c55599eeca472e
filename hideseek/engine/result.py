"""What a sharpness call returns: :class:`SharpnessResult`, the per-batch
:class:`BatchRecord` the ranks exchange, and the norm accounting of the maximiser
(:mod:`hideseek.engine`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from torch import Tensor, nn

from ..geometry.space import ProductGeometry
from ..measures import Measure
from ..solvers.apgd import SolverResult
from ..symmetries.base import SymmetryBlock
from ..symmetries.discover import find_symmetries


@dataclass
class SharpnessResult:
    """Sharpness of a model on a set of batches.

    ``value`` is the mean of ``per_batch``; ``base_losses`` the loss at θ per batch;
    ``measure`` what was measured (``name`` is ``measure.name``, ``config`` the settings as
    a plain dict, as before).

    Examples
    --------
    >>> import torch, hideseek as hs
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2, bias=False)).eval()
    >>> pair = hs.FactorPair("1.weight", "0.weight", transpose_h=True)    # W₁W₀ = G Hᵀ, G = W₁, H = W₀ᵀ
    >>> batch, mse = (torch.randn(16, 3), torch.randn(16, 2)), torch.nn.functional.mse_loss
    >>> res = hs.sharpness(model, [batch, batch], "geodesic_mixed", rho=0.1, n_iters=5, loss_fn=mse,
    ...                    pairs=[pair], progress=False)
    >>> len(res.per_batch), res.value == sum(res.per_batch) / 2       # the mean over the batches
    (2, True)
    >>> abs(res.base_losses[0] - mse(model(batch[0]), batch[1]).item()) < 1e-6   # the loss at θ
    True
    """

    value: float
    per_batch: list[float]
    base_losses: list[float]
    name: str
    config: dict[str, Any]
    seconds: float
    n_perturbed: int = 0
    pairs: list[dict] = field(default_factory=list)
    #: largest ‖½γ̈(0)‖/‖ξ‖ over pairs at the maximiser of each batch (second-order steps only)
    correction_ratio: list[float] = field(default_factory=list)
    solver: list[SolverResult] = field(default_factory=list, repr=False)
    measure: Measure = field(default_factory=Measure)
    #: where the worst case lives: the share of the maximiser's squared norm (in the
    #: measure's own norm) per kind of pair — ``"qk"``, ``"vo"``, ``"qk_rotary"``, user labels
    #: — and ``"free"`` (every other parameter), summing to 1, averaged over the batches with
    #: a non-zero maximiser.  Empty for the average case and the ℓ∞ ball.
    norm_share: dict[str, float] = field(default_factory=dict)
    #: names of the parameter tensors perturbed (by default those that require gradients and
    #: get one, minus ``exclude``; frozen ones stay fixed) and their number
    perturbed_params: list[str] = field(default_factory=list)
    n_perturbed_params: int = 0
    #: the value of every Auto-PGD start per batch (``restarts=``): the first from ξ = 0 (or
    #: the random start), then the random ones; ``per_batch`` is each batch's maximum.  One
    #: entry per batch (the value) for the average case and ``restarts=1``.
    restart_values: list[list[float]] = field(default_factory=list)
    #: how the ranks of a ``torch.distributed`` process group took part
    #: (:mod:`hideseek.distributed`): ``"none"`` (one process, or ``distributed=False``),
    #: ``"data"`` (each rank measured its own batches; results gathered) or ``"sharded"``
    #: (FSDP2: every rank took part in every batch, the model's weights sharded)
    parallel: str = "none"
    #: ranks in the process group whose batches the result covers (1 when not combined)
    world_size: int = 1
    #: whether ``per_batch`` holds every rank's batches (rank 0's first), the same result on
    #: every rank
    combined: bool = False
    #: batches each rank brought, in rank order (empty when not combined)
    batches_per_rank: list[int] = field(default_factory=list)
    #: the collectives hideseek itself called, by name (FSDP2's own all-gathers and
    #: reduce-scatters inside each pass not counted): docs/architecture.md, "Ranks"
    collectives: dict[str, int] = field(default_factory=dict)
    #: a half-precision forward pass (half-precision weights, frozen ones included, or
    #: ``autocast``): what a difference of two losses cannot resolve (computed on batch 0,
    #: :func:`hideseek.precision.loss_resolution`), and whether ``|value|`` is below it (then
    #: a warning says so); ``None`` / ``False`` in full precision
    resolution: float | None = None
    below_resolution: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("solver")
        return d


# ---------------------------------------------------------------------------- where
def norm_share(geometry: ProductGeometry, xi: list[Tensor],
               blocks: Sequence[SymmetryBlock] = ()) -> dict[str, float]:
    """Share of ``‖ξ‖²`` (the geometry's own ℓ2 norm) per kind of pair and ``"free"``,
    summing to 1 (empty when ξ = 0).  ``blocks``: pairs to account for among the geometry's
    free parameters (the adaptive measure's), see :meth:`ProductGeometry.sqnorm_by_kind`."""
    parts = geometry.sqnorm_by_kind(xi, blocks)
    total = sum(parts.values())
    if not total > 0:
        return {}
    return {k: v / total for k, v in parts.items()}


def accounting_blocks(model: nn.Module, measure: Measure,
                       blocks: Sequence[SymmetryBlock]) -> list[SymmetryBlock] | None:
    """Blocks to split the maximiser's norm by (``None``: no share is reported)."""
    if measure.kind != "worst" or measure.p != "l2":
        return None
    if blocks:
        return []
    # the adaptive measure: its parameters are all free; account for attention pairs anyway
    return find_symmetries(model, on_unsupported="adaptive")


def mean_shares(shares: list[dict[str, float]]) -> dict[str, float]:
    if not shares:
        return {}
    keys = sorted({k for s in shares for k in s}, key=lambda k: (k == "free", k))
    return {k: sum(s.get(k, 0.0) for s in shares) / len(shares) for k in keys}


@dataclass
class BatchRecord:
    """What one batch adds to a :class:`SharpnessResult`, as plain Python values (what the
    ranks of a distributed run exchange, :mod:`hideseek.distributed`)."""

    value: float                       # sharpness of the batch (its best start)
    base: float                        # L(θ) on the batch
    starts: list[float]                # every start's value
    ratio: float | None = None         # largest ‖½γ̈(0)‖/‖ξ‖ at the maximiser (second-order steps)
    share: dict[str, float] | None = None   # the maximiser's norm share per kind (ℓ2 worst case)
