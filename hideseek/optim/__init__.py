"""Training against sharpness: SAM, ASAM and geodesic SAM from one optimizer
(:class:`~hideseek.optim.sam.SAM`), and a Hugging Face ``Trainer`` that uses it
(:mod:`hideseek.optim.hf`, imported on demand: it needs ``transformers``)."""
from .sam import SAM, frozen_norm_stats

__all__ = ["SAM", "frozen_norm_stats"]
