"""Training against sharpness: SAM, ASAM and geodesic SAM from one optimizer
(:class:`~hideseek.optim.sam.SAM`), and a Hugging Face ``Trainer`` that uses it
(:mod:`hideseek.optim.hf`, imported on demand: it needs ``transformers``).

Examples
--------
>>> import copy, torch, hideseek as hs
>>> _ = torch.manual_seed(0)
>>> model = torch.nn.Linear(3, 2)
>>> x, y = torch.randn(8, 3), torch.randn(8, 2)
>>> loss = lambda m: torch.nn.functional.mse_loss(m(x), y)
>>> sam = hs.optim.SAM(model, torch.optim.AdamW(model.parameters(), lr=0.05), hs.Measure(geometry="adaptive"),
...                    rho=0.1)                                   # ASAM; Measure(metric=...) for geodesic SAM
>>> def closure():
...     sam.zero_grad()
...     value = loss(model)
...     value.backward()
...     return value
>>> start = loss(model).item()
>>> for _ in range(20):
...     _ = closure()                                            # the gradient at θ, then the whole step
...     _ = sam.step(closure)
>>> loss(model).item() < start
True
"""
from .sam import SAM, frozen_norm_stats

__all__ = ["SAM", "frozen_norm_stats"]
