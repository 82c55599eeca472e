"""A Hugging Face ``Trainer`` that trains with :class:`~hideseek.optim.sam.SAM`.

Only the training step changes: the gradient of the micro-batch at θ, the ascent step in the
measure's ball, the gradient at the perturbed point (norm-layer statistics left as the first
pass set them, :func:`~hideseek.optim.sam.frozen_norm_stats`), the weights put back.  The
Trainer's own machinery then runs as usual on that gradient: accumulation, clipping, the
optimizer it built (or the one passed in ``optimizers=``), its LR scheduler, mixed precision
(the ascent direction is normalised, so the loss scale does not matter).

With gradient accumulation every micro-batch takes its own ascent step (the gradients at
the perturbed points are accumulated): SAM's m-sharpness with m the micro-batch size.
Tested in one process; under DistributedDataParallel the first backward all-reduces, so
every process ascends along the global gradient of the micro-batch.

>>> trainer = SAMTrainer(model=model, args=args, train_dataset=ds,
...                      sam_measure=hs.Measure(metric="mixed"), sam_rho=0.02)   # doctest: +SKIP
>>> trainer.train()                                                              # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn
from transformers import Trainer

from ..measures import Measure
from ..symmetries.base import SymmetryBlock
from .sam import SAM, frozen_norm_stats


class SAMTrainer(Trainer):
    """``transformers.Trainer`` whose training step is SAM's ascent-then-gradient.

    ``sam_measure``, ``sam_rho``, ``sam_pairs`` are :class:`~hideseek.optim.sam.SAM`'s
    ``measure``, ``rho``, ``pairs``; every other argument is the Trainer's.  The
    :class:`~hideseek.optim.sam.SAM` object (``trainer.sam``) is built on the Trainer's
    optimizer at the first step.

    Examples
    --------
    >>> import tempfile, torch, transformers, hideseek as hs
    >>> from hideseek.optim.hf import SAMTrainer
    >>> class Regression(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(3, 1)
    ...     def forward(self, x, labels):
    ...         return {"loss": torch.nn.functional.mse_loss(self.lin(x), labels)}
    >>> inputs = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    >>> data = [{"x": x, "labels": x.sum(0, keepdim=True)} for x in inputs]
    >>> def train(trainer_class, **sam):
    ...     _ = torch.manual_seed(0)
    ...     model = Regression()
    ...     args = transformers.TrainingArguments(tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=4,
    ...                                           learning_rate=0.1, report_to=[], save_strategy="no", use_cpu=True)
    ...     trainer = trainer_class(model=model, args=args, train_dataset=data, **sam)
    ...     trainer.remove_callback(transformers.trainer_callback.ProgressCallback)
    ...     _ = trainer.train()
    ...     return trainer, model.lin.weight.detach().clone()
    >>> trainer, w_sam = train(SAMTrainer, sam_measure=hs.Measure(geometry="euclidean"), sam_rho=0.05)
    >>> isinstance(trainer.sam, hs.optim.SAM), trainer.state.global_step
    (True, 4)
    >>> _, w_zero = train(SAMTrainer, sam_measure=hs.Measure(geometry="euclidean"), sam_rho=0.0)
    >>> _, w_plain = train(transformers.Trainer)
    >>> torch.allclose(w_zero, w_plain), torch.allclose(w_sam, w_plain)   # ρ = 0 is the Trainer's own step
    (True, False)
    """

    def __init__(self, *args: Any, sam_measure: Measure | str = Measure(), sam_rho: float = 0.05,
                 sam_pairs: Sequence[SymmetryBlock] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sam_measure, self.sam_rho, self.sam_pairs = Measure.parse(sam_measure), sam_rho, sam_pairs
        self.sam: SAM | None = None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None):
        if self.sam is None:
            self.sam = SAM(self.model, self.optimizer, self.sam_measure, rho=self.sam_rho, pairs=self.sam_pairs)
        # the gradients of earlier micro-batches (accumulation) wait aside
        held = [(p, p.grad) for _, p in self.sam._named if p.grad is not None]
        for p, _ in held:
            p.grad = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.sam.first_step(zero_grad=True)
        with frozen_norm_stats(model):
            super().training_step(model, inputs, num_items_in_batch)
        self.sam.restore()
        for p, g in held:
            p.grad = g if p.grad is None else p.grad.add_(g)
        return loss
