"""Maximisers over a ball of perturbations."""
from .apgd import SolverResult, apgd, apgd_checkpoints, average_case, random_search

__all__ = ["SolverResult", "apgd", "apgd_checkpoints", "average_case", "random_search"]
