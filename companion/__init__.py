"""The paper companion of hideseek: everything that exists to rebuild the figures and
Table 1 of *Hide & Seek* (ICML 2025) — experiments, asset loaders for the paper's own
checkpoints and data, the papermill/DVC notebook runner, Table 1.

The library (:mod:`hideseek`) never imports this package.
"""
